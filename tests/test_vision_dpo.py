"""DPO and reward modelling with images (issue 68): preference pairs whose prompts hold images train a tiny
random Qwen2.5-VL with DPO on 2 gloo ranks, one of them without an image in every step, and its loss falls;
a vision-language reward model is refused with a ConfigError that says why."""

import json
import os

import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from conftest import run_torchrun
from rl2.config import load_config
from rl2.data.conversations import PairDataset, last_run
from rl2.data.image_rows import ImageInputs
from rl2.data.rows import Columns
from rl2.metrics import read_metrics
from test_sft import run_python_raw

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}
STEPS = 8


@pytest.fixture(scope="module")
def colour_pairs(tmp_path_factory) -> str:
    """Pairs alternating: an image of one colour (its name chosen, the next colour's rejected), then a text-only
    pair. With `data.batch_size=2` unshuffled each step's two pairs go one to each rank: one rank has no image."""
    folder = str(tmp_path_factory.mktemp("pairs"))
    names = list(COLOURS)
    rows = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        path = os.path.join(folder, f"{name}.png")
        Image.new("RGB", (56, 56), rgb).save(path)
        rows.append({"messages": [{"role": "user", "content": "<image> which colour is this?"}], "images": [path],
                     "chosen": name, "rejected": names[(i + 1) % len(names)]})
        rows.append({"messages": [{"role": "user", "content": f"count to {i + 1}"}], "images": [],
                     "chosen": " ".join(["one", "two", "three", "four"][:i + 1]), "rejected": "no"})
    path = os.path.join(folder, "pairs.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def test_an_image_pair_holds_the_prompts_images_in_both_and_the_response_alone_in_the_loss(vlm_dir, colour_pairs):
    config = load_config([f"actor.model_name={vlm_dir}", f"data.path={colour_pairs}"], "dpo")
    dataset = PairDataset.reading_images(ImageInputs.for_model(vlm_dir, config.data))(
        colour_pairs, AutoTokenizer.from_pretrained(vlm_dir), 128, columns=Columns.for_run(config, "pair"))
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    item = dataset[0]
    chosen, rejected = item["chosen"], item["rejected"]
    assert torch.equal(chosen["pixel_values"], rejected["pixel_values"]) and chosen["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert tokenizer.decode(chosen["input_ids"][chosen["loss_mask"].bool()]).startswith("red")
    assert tokenizer.decode(rejected["input_ids"][rejected["loss_mask"].bool()]).startswith("green")
    assert "pixel_values" not in dataset[1]["chosen"]
    assert last_run(torch.tensor([0, 1, 1, 0, 1, 1, 0])).tolist() == [0, 0, 0, 0, 1, 1, 0]


def test_dpo_on_two_ranks_one_without_images_learns_the_image_pairs(vlm_dir, colour_pairs, tmp_path):
    save_dir = str(tmp_path / "dpo")
    run_torchrun(["-m", "rl2.trainer.dpo", f"data.path={colour_pairs}", "data.test_ratio=0", "data.batch_size=2",
                  "data.shuffle=false", f"actor.model_name={vlm_dir}", "actor.dtype=float32", "actor.lr=1e-2",
                  "actor.warmup_ratio=0", "actor.max_length_per_device=128", "actor.gradient_checkpointing=false",
                  f"actor.save_dir={save_dir}", f"trainer.total_steps={STEPS}", "trainer.disable_wandb=true"],
                 nproc=2, timeout=300)
    metrics = read_metrics(f"{save_dir}/metrics.jsonl")
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == STEPS
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)  # the policy starts as its reference
    assert max(losses[-2:]) < losses[0] - 0.1, losses
    assert os.path.exists(f"{save_dir}/step{STEPS}/preprocessor_config.json")  # the checkpoint reads images


def test_a_vision_language_reward_model_is_refused_saying_why(vlm_dir, colour_pairs):
    result = run_python_raw(["-m", "rl2.trainer.rm", f"data.path={colour_pairs}", f"critic.model_name={vlm_dir}",
                             "trainer.disable_wandb=true"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "is a vision-language model: rl2 trains no reward model on those yet" in result.stderr
