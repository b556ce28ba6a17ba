"""SFT of a vision-language model end to end (issue 68): a tiny random Qwen2.5-VL, built offline, learns
rows with and without images on 2 gloo ranks, one of them image-free in every step; its vision tower stays
frozen; a bad row stops the run naming the row and field."""

import json
import os
import shutil

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText

from conftest import run_python, run_torchrun
from rl2.config import ConfigError, LoraConfig, load_config
from rl2.data.conversations import SFTDataset
from rl2.data.image_rows import ImageInputs
from rl2.data.rows import Columns, DataError, load_rows, validate_rows
from rl2.lora import add_lora
from rl2.metrics import read_metrics
from rl2.testing.tiny_vlm import build_tiny_vlm_tokenizer
from rl2.vision.positions import VISION_POSITIONS

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
STEPS = 16


def write_rows(folder, rows: list[dict]) -> str:
    path = os.path.join(folder, "rows.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


@pytest.fixture(scope="module")
def colour_rows(tmp_path_factory) -> str:
    """Rows alternating: an image of one colour (asked its name), then a text-only row. With
    `data.batch_size=2` unshuffled, each step's two rows go one to each rank: rank 1 never has an image."""
    folder = str(tmp_path_factory.mktemp("colours"))
    rows = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        path = os.path.join(folder, f"{name}.png")
        Image.new("RGB", (56, 56), rgb).save(path)
        rows.append({"messages": [{"role": "user", "content": "<image> which colour is this?"},
                                  {"role": "assistant", "content": name}], "images": [path]})
        rows.append({"messages": [{"role": "user", "content": f"say word {i}"},
                                  {"role": "assistant", "content": ["one", "two", "three", "four"][i]}],
                     "images": []})
    return write_rows(folder, rows)


def sft_args(model_dir: str, data: str, save_dir: str, steps: int, *extra: str) -> list[str]:
    return ["-m", "rl2.trainer.sft", f"data.path={data}", "data.test_ratio=0", "data.batch_size=2",
            "data.shuffle=false", f"actor.model_name={model_dir}", "actor.dtype=float32", "actor.lr=1e-2",
            "actor.warmup_ratio=0", "actor.max_length_per_device=128", "actor.gradient_checkpointing=false",
            f"actor.save_dir={save_dir}", f"trainer.total_steps={steps}", "trainer.disable_wandb=true", *extra]


@pytest.fixture(scope="module")
def two_rank_run(vlm_dir, colour_rows, tmp_path_factory) -> str:
    save_dir = str(tmp_path_factory.mktemp("two_ranks"))
    run_torchrun(sft_args(vlm_dir, colour_rows, save_dir, STEPS, f"actor.save_freq={STEPS // 2}"), nproc=2, timeout=300)
    return save_dir


def test_two_ranks_one_without_images_learn_rows_with_and_without_images(two_rank_run):
    metrics = read_metrics(os.path.join(two_rank_run, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    losses = [m["loss"] for m in metrics]
    epoch = 4  # steps an epoch: 8 rows, 2 a step
    assert sum(losses[-epoch:]) < 0.5 * sum(losses[:epoch]), losses
    assert all(m["loss_tokens"] > 0 and m["grad_norm"] > 0 for m in metrics)


def test_the_frozen_vision_tower_is_unchanged_in_the_checkpoint_and_the_rest_trained(two_rank_run, vlm_dir):
    final = os.path.join(two_rank_run, f"step{STEPS}")
    trained = AutoModelForImageTextToText.from_pretrained(final, dtype=torch.float32).state_dict()
    start = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).state_dict()
    assert trained.keys() == start.keys()
    tower = [name for name in start if name.startswith("model.visual.")]
    assert tower and all(torch.equal(trained[name], start[name]) for name in tower)
    assert all(not torch.equal(trained[name], start[name]) for name in start
               if name.startswith("model.language_model.layers."))
    assert AutoImageProcessor.from_pretrained(final, backend="pil").patch_size == 14  # it reloads as a VLM


def test_a_resumed_run_trains_on_the_same_batches_to_the_same_losses(two_rank_run, vlm_dir, colour_rows, tmp_path):
    """Rows are built a batch ahead on a data thread; the checkpoint's data position is still the step's."""
    resumed = str(tmp_path / "resumed")
    shutil.copytree(two_rank_run, resumed)
    shutil.rmtree(os.path.join(resumed, f"step{STEPS}"))
    run_torchrun(sft_args(vlm_dir, colour_rows, resumed, STEPS, "trainer.load_ckpt_from=latest"), nproc=2, timeout=300)
    expected = read_metrics(os.path.join(two_rank_run, "metrics.jsonl"))
    again = read_metrics(os.path.join(resumed, "metrics.jsonl"))
    assert [m["step"] for m in again] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in again] == [m["loss"] for m in expected]


def test_one_rank_gives_the_first_step_loss_of_two(two_rank_run, vlm_dir, colour_rows, tmp_path):
    """The loss is a sum over ranks of globally weighted terms: the world size does not change it (up to the
    order of the float sums)."""
    run_torchrun(sft_args(vlm_dir, colour_rows, str(tmp_path / "one"), 1), nproc=1, timeout=300)
    one = read_metrics(str(tmp_path / "one" / "metrics.jsonl"))[0]
    two = read_metrics(os.path.join(two_rank_run, "metrics.jsonl"))[0]
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-6, abs=0)
    assert one["loss_tokens"] == two["loss_tokens"]


def test_a_missing_image_stops_the_run_naming_the_row_and_field(vlm_dir, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "images": []},
            {"messages": [{"role": "user", "content": "<image> what?"}, {"role": "assistant", "content": "a"}],
             "images": [str(tmp_path / "gone.png")]}]
    data = write_rows(tmp_path, rows)
    result = run_torchrun(sft_args(vlm_dir, data, str(tmp_path / "run"), 1), nproc=1, check=False, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"rl2: error: {data}, row 2, 'images'[0]: image file not found: {tmp_path / 'gone.png'}" in result.stderr


def test_an_image_count_that_does_not_match_is_found_before_training(vlm_dir, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "<image> and <image>"}, {"role": "assistant", "content": "a"}],
             "images": ["one.png"]}]
    data = write_rows(tmp_path, rows)
    with pytest.raises(DataError, match=rf"{data}, row 1: 'images' has 1 image\(s\) but the messages have 2"):
        validate_rows(load_rows(data), "sft", data, Columns(image_key="images"))


def test_vision_samples_carry_their_mrope_positions_and_images(vlm_dir, colour_rows):
    config = load_config([f"actor.model_name={vlm_dir}", f"data.path={colour_rows}", "data.max_pixels=784"], "sft")
    columns = Columns.for_run(config, "sft")
    assert columns.image_key == "images"
    images = ImageInputs.for_model(vlm_dir, config.data)
    dataset = SFTDataset.reading_images(images)(colour_rows, build_tiny_vlm_tokenizer(), None, columns=columns)
    with_image, text_only = dataset[0], dataset[1]
    assert with_image["image_grid_thw"].tolist() == [[1, 2, 2]]  # max_pixels: 28 x 28, one merged patch
    length = len(with_image["input_ids"])
    assert with_image[VISION_POSITIONS].shape == (3, length) and int(with_image["mm_token_type_ids"].sum()) == 1
    assert "pixel_values" not in text_only
    positions = torch.arange(len(text_only["input_ids"]))
    assert torch.equal(text_only[VISION_POSITIONS], positions.expand(3, -1))  # text only: mRoPE is 1-D RoPE


def test_a_text_model_reads_no_image_column(tiny_model_dir):
    config = load_config([f"actor.model_name={tiny_model_dir}"], "sft")
    assert Columns.for_run(config, "sft").image_key is None
    assert ImageInputs.for_model(tiny_model_dir, config.data) is None


def test_lora_adapters_stay_off_the_vision_tower(vlm_dir):
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    adapted = [name for name, _ in add_lora(model, LoraConfig(rank=4)).named_modules() if name.endswith("lora_A")]
    assert len(adapted) == 14 and not any(".visual." in name for name in adapted)  # 2 layers x 7 projections


@pytest.mark.parametrize("key, commands", [
    ("data.image_key=pics", ("sft", "ppo", "dpo", "rm")), ("data.max_pixels=1000", ("sft", "ppo", "dpo", "rm")),
    ("actor.freeze_vision=false", ("sft", "ppo", "dpo")), ("critic.freeze_vision=false", ("ppo", "rm")),
])
def test_the_image_keys_belong_to_the_commands_that_train_on_images(key, commands):
    for command in ("sft", "ppo", "dpo", "rm", "filter", "search"):
        if command in commands:
            load_config([key], command)
        else:
            with pytest.raises(ConfigError):
                load_config([key], command)


def test_qwen3_vl_with_its_deepstack_features_trains_beside_an_image_free_rank(colour_rows, tmp_path):
    model_dir = str(tmp_path / "qwen3_vl")
    run_python(["-m", "rl2.testing.tiny_vlm", model_dir, "--family", "qwen3_vl"])
    run_torchrun(sft_args(model_dir, colour_rows, str(tmp_path / "run"), 4), nproc=2, timeout=300)
    losses = [m["loss"] for m in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))]
    assert len(losses) == 4 and losses[-1] < losses[0]
