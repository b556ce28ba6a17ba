"""The real PPO trainer (`python -m rl2.trainer.ppo`, 2 gloo ranks, the `hf` engine) runs GRPO on a tiny random
Qwen2.5-VL with rows whose prompts hold images (issue 68): the run finishes with finite metrics, the dumped
trajectories name their images, and the frozen vision tower is unchanged in the checkpoint while the text
model trains. In the first step one rank's prompt has no image (it runs the vision tower on a placeholder). Per-turn
trajectories whose tool answers with an image train too, and an agent's conversations with images sent to rl2's
OpenAI server."""

import json
import math

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoTokenizer

from conftest import run_python, run_torchrun
from rl2.vision.inputs import image_pad_id

# The reply's first character's parity: rewards differ within a group of a random model's replies.
ENV = '''def reward_fn(messages, answer):
    reply = messages[-1]["content"]
    return float(ord(reply[:1] or "a") % 2)
'''


def write_rows(folder) -> str:
    """Four rows in order (data.shuffle=false): step 1 gives rank 0 an image row and rank 1 a text row; step 2
    gives rank 0 a row with two images of different sizes and rank 1 one image."""
    colours = [(200, 30, 30), (30, 30, 200), (30, 200, 30)]
    paths = []
    for i, colour in enumerate(colours):
        path = folder / f"{i}.png"
        Image.new("RGB", (56, 56) if i != 1 else (84, 56), colour).save(path)
        paths.append(str(path))
    rows = [
        {"messages": [{"role": "user", "content": "<image>What colour?"}], "images": paths[:1], "answer": "r"},
        {"messages": [{"role": "user", "content": "Say a colour."}], "images": [], "answer": "r"},
        {"messages": [{"role": "user", "content": "<image> or <image>?"}], "images": paths[1:], "answer": "b"},
        {"messages": [{"role": "user", "content": "<image>What colour?"}], "images": paths[2:], "answer": "g"},
    ]
    data = folder / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(data)


def vision_weights(path: str) -> dict[str, torch.Tensor]:
    """The vision tower's tensors of a safetensors file, by name from `visual.` on."""
    return {key[key.index("visual."):]: value for key, value in load_file(path).items() if "visual." in key}


def text_weights(path: str) -> dict[str, torch.Tensor]:
    return {key[key.index("layers."):]: value for key, value in load_file(path).items()
            if "layers." in key and "visual." not in key}


def test_ppo_trainer_runs_grpo_on_image_rows(tmp_path):
    model = str(tmp_path / "model")
    run_python(["-m", "rl2.testing.tiny_vlm", model, "--family", "qwen2_5_vl"])
    data = write_rows(tmp_path)
    env = tmp_path / "env.py"
    env.write_text(ENV)
    save = tmp_path / "ppo"
    run_torchrun([
        "-m", "rl2.trainer.ppo", f"data.path={data}", "data.shuffle=false",
        "data.prompts_per_rollout=2", "data.responses_per_prompt=4",
        f"actor.model_name={model}", "actor.dtype=float32", "actor.gradient_checkpointing=false",
        "actor.lr=1e-2", "actor.warmup_ratio=0", f"actor.save_dir={save}",
        f"rollout.env_path={env}", "rollout.max_turns=1",
        "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 3}",
        "adv.estimator=reinforce", "adv.norm_var=true",
        "trainer.total_steps=2", "trainer.test_freq=null", "trainer.seed=3", "trainer.disable_wandb=true",
    ], nproc=2)

    metrics = [json.loads(line) for line in open(save / "metrics.jsonl")]
    steps = [row for row in metrics if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert all(math.isfinite(value) for value in row.values() if isinstance(value, float)), row
    assert any("actor/loss" in key or "grad_norm" in key for row in steps for key in row), steps

    dump = [json.loads(line) for line in open(save / "trajectories" / "step_1.jsonl")]
    assert len(dump) == 8
    with_images = [t for t in dump if "images" in t]
    assert len(with_images) == 4 and all(t["images"] == [[1, 4, 4]] for t in with_images)
    assert all("<|image_pad|>" in t["messages"][0]["content"] for t in with_images)
    dump = [json.loads(line) for line in open(save / "trajectories" / "step_2.jsonl")]
    assert sorted(len(t["images"]) for t in dump) == [1] * 4 + [2] * 4

    before, after = vision_weights(f"{model}/model.safetensors"), vision_weights(f"{save}/step2/model.safetensors")
    assert before.keys() == after.keys() and len(before) > 0
    assert all(torch.equal(before[key], after[key]) for key in before)  # actor.freeze_vision (default on)
    before, after = text_weights(f"{model}/model.safetensors"), text_weights(f"{save}/step2/model.safetensors")
    assert any(not torch.equal(before[key], after[key]) for key in before)  # the text model trained


# Per turn: the tool answers every first reply with an image; the second turn's sequence holds both images.
TOOL_ENV = '''
from PIL import Image


def reward_fn(messages, answer):  # the parity of all the replies' length: rewards differ within a group
    return float(sum(len(m["content"]) for m in messages if m["role"] == "assistant") % 2)


def interact(messages):
    if len(messages) == 2:  # the prompt and the first reply
        return [{"role": "user", "content": [{"type": "text", "text": "here:"},
                                             {"type": "image", "image": Image.new("RGB", (84, 56), (0, 0, 255))}]}]
    return []
'''


def test_ppo_trainer_runs_per_turn_trajectories_whose_tool_returns_an_image(tmp_path):
    """rollout.trajectory_format=per_turn with the `hf` engine: each trajectory's second sequence holds its prompt's
    images and the tool's; the run trains (one rank's first prompt has no image of its own) with finite metrics."""
    model = str(tmp_path / "model")
    run_python(["-m", "rl2.testing.tiny_vlm", model, "--family", "qwen2_5_vl"])
    data = write_rows(tmp_path)
    env = tmp_path / "env.py"
    env.write_text(TOOL_ENV)
    save = tmp_path / "ppo"
    tokenizer = AutoTokenizer.from_pretrained(model)
    stops = [i for i in range(0, len(tokenizer), 2) if i != image_pad_id(tokenizer)]
    run_torchrun([
        "-m", "rl2.trainer.ppo", f"data.path={data}", "data.shuffle=false",
        "data.prompts_per_rollout=2", "data.responses_per_prompt=2",
        f"actor.model_name={model}", "actor.dtype=float32", "actor.gradient_checkpointing=false",
        "actor.lr=1e-2", "actor.warmup_ratio=0", f"actor.save_dir={save}",
        f"rollout.env_path={env}", "rollout.max_turns=2", "rollout.trajectory_format=per_turn",
        # half the tokens stop a reply (a random model's replies would never end), so replies and rewards differ
        f"rollout.train_sampling_params={{temperature: 1.0, max_new_tokens: 8, stop_token_ids: {stops}}}",
        "adv.estimator=reinforce", "adv.norm_var=true",
        "trainer.total_steps=1", "trainer.test_freq=null", "trainer.seed=3", "trainer.disable_wandb=true",
    ], nproc=2)

    metrics = [json.loads(line) for line in open(save / "metrics.jsonl")]
    steps = [row for row in metrics if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1]
    assert all(math.isfinite(value) for value in steps[0].values() if isinstance(value, float)), steps
    assert steps[0]["actor/grad_norm"] > 0
    dump = [json.loads(line) for line in open(save / "trajectories" / "step_1.jsonl")]
    assert len(dump) == 4 and all(not t["errors"] and t["turns"] == 2 for t in dump), dump
    # the tool's image after the prompt's (rank 1's prompt has none of its own)
    assert sorted(len(t["images"]) for t in dump) == [1, 1, 2, 2]
    assert all(t["images"][-1] == [1, 4, 6] for t in dump)


AGENT = '''
import base64
import io

from PIL import Image


def data_uri(colour) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def run(row, client):
    """Two conversations (two sequences), each with an image of its own; the reward: the replies' length parity."""
    replies = []
    for colour, text in (((200, 30, 30), "what colour?"), ((30, 30, 200), "and this one?")):
        content = [{"type": "image_url", "image_url": {"url": data_uri(colour)}}, {"type": "text", "text": text}]
        reply = await client.chat.completions.create(model="rl2", messages=[{"role": "user", "content": content}],
                                                     max_tokens=8)
        replies.append(reply.choices[0].message.content or "")
    return float(sum(len(reply) for reply in replies) % 2)
'''


def test_ppo_trainer_runs_an_agent_whose_requests_hold_images(tmp_path):
    """rollout.agent_path with the `hf` engine behind rl2's OpenAI server: an agent's two conversations, each with an
    image sent as a data URI, train as two sequences of its trajectory, each with its own image."""
    pytest.importorskip("openai")
    model = str(tmp_path / "model")
    run_python(["-m", "rl2.testing.tiny_vlm", model, "--family", "qwen2_5_vl"])
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"row {i}"}], "answer": "x"}) + "\n"
                            for i in range(2)))
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    save = tmp_path / "ppo"
    tokenizer = AutoTokenizer.from_pretrained(model)
    stops = [i for i in range(0, len(tokenizer), 2) if i != image_pad_id(tokenizer)]
    run_torchrun([
        "-m", "rl2.trainer.ppo", f"data.path={data}", "data.shuffle=false",
        "data.prompts_per_rollout=2", "data.responses_per_prompt=2",
        f"actor.model_name={model}", "actor.dtype=float32", "actor.gradient_checkpointing=false",
        "actor.lr=1e-2", "actor.warmup_ratio=0", f"actor.save_dir={save}", f"rollout.agent_path={agent}",
        f"rollout.train_sampling_params={{temperature: 1.0, max_new_tokens: 8, stop_token_ids: {stops}}}",
        "adv.estimator=reinforce", "adv.norm_var=true",
        "trainer.total_steps=1", "trainer.test_freq=null", "trainer.seed=3", "trainer.disable_wandb=true",
    ], nproc=2)

    metrics = [json.loads(line) for line in open(save / "metrics.jsonl")]
    steps = [row for row in metrics if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1]
    assert all(math.isfinite(value) for value in steps[0].values() if isinstance(value, float)), steps
    assert steps[0]["actor/grad_norm"] > 0 and steps[0]["agent/sequences"] == 2
    dump = [json.loads(line) for line in open(save / "trajectories" / "step_1.jsonl")]
    assert len(dump) == 4 and all(not t["errors"] and t["images"] == [[1, 4, 4], [1, 4, 4]] for t in dump), dump
