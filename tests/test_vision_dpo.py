"""DPO and reward modelling with images (issue 68): preference pairs whose prompts hold images train a tiny
random Qwen2.5-VL with DPO and as a reward model (its backbone with a value head) on 2 gloo ranks, one of them
without an image in every step, and their losses fall; the reward model's checkpoint reloads to the same rewards."""

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
from rl2.vision.value_model import Qwen2_5_VLForSequenceClassification

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


def test_a_vision_language_reward_model_on_two_ranks_learns_the_image_pairs_and_reloads(vlm_dir, colour_pairs, tmp_path):
    """The reward model is the VLM's backbone with a fresh `score` head (`rl2.vision.value_model`); its exported
    folder loads with `Qwen2_5_VLForSequenceClassification`, whose reward of each sequence alone with its images
    gives the test loss and accuracy the packed run logged (the test set is the training set here)."""
    save_dir = str(tmp_path / "rm")
    run_torchrun(["-m", "rl2.trainer.rm", f"data.path={colour_pairs}", f"data.test_path={colour_pairs}",
                  "data.batch_size=2", "data.shuffle=false", f"critic.model_name={vlm_dir}", "critic.dtype=float32",
                  "critic.lr=1e-2", "critic.warmup_ratio=0", "critic.max_length_per_device=128",
                  "critic.gradient_checkpointing=false", f"critic.save_dir={save_dir}", f"trainer.total_steps={STEPS}",
                  f"trainer.test_freq={STEPS}", "trainer.disable_wandb=true"], nproc=2, timeout=300)
    metrics = read_metrics(f"{save_dir}/metrics.jsonl")
    losses = [m["loss"] for m in metrics if "loss" in m]
    tests = [m for m in metrics if "test/loss" in m]
    assert len(losses) == STEPS and [m["step"] for m in tests] == [0, STEPS]
    assert tests[-1]["test/loss"] < tests[0]["test/loss"] - 0.1, tests
    final = f"{save_dir}/step{STEPS}"
    assert os.path.exists(f"{final}/preprocessor_config.json")  # the checkpoint reads images

    model = Qwen2_5_VLForSequenceClassification.from_pretrained(final, dtype=torch.float32, attn_implementation="sdpa")
    config = load_config([f"critic.model_name={vlm_dir}", f"data.path={colour_pairs}"], "rm")
    dataset = PairDataset.reading_images(ImageInputs.for_model(vlm_dir, config.data))(
        colour_pairs, AutoTokenizer.from_pretrained(vlm_dir), None, columns=Columns.for_run(config, "pair"))
    rewards = {"chosen": [], "rejected": []}
    with torch.no_grad():
        for i in range(len(dataset)):
            for field, sample in dataset[i].items():
                images = {key: sample[key] for key in ("pixel_values", "image_grid_thw") if key in sample}
                out = model(input_ids=sample["input_ids"][None], mm_token_type_ids=sample["mm_token_type_ids"][None],
                            **images)
                rewards[field].append(out.logits[0, 0].item())
    chosen, rejected = torch.tensor(rewards["chosen"]), torch.tensor(rewards["rejected"])
    loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean().item()
    assert loss == pytest.approx(tests[-1]["test/loss"], abs=1e-4)
    assert (chosen > rejected).float().mean().item() == tests[-1]["test/accuracy"]


def test_the_image_keys_are_rm_keys():
    for key in ("data.image_key=pics", "data.min_pixels=100", "data.max_pixels=1000", "critic.freeze_vision=false"):
        load_config([key], "rm")
