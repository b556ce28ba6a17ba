"""PPO/GRPO with images (issue 68): a fixed batch of trajectories whose prompts hold images goes through the
stages of a PPO step on a tiny random Qwen2.5-VL. The log-probs the trainer computes equal a plain transformers
forward of each sequence alone with its images; 2 gloo ranks, one of them without an image, update the policy
as 1 rank does, and so do 2 ranks that split each row (actor.sp_size=2); the vision tower stays frozen while
the text model trains. A vision-language critic's values of rows that mix sequences with and without images equal
each sequence's alone, and it saves and reloads to the same values. Trajectories of several sequences (per turn,
with a tool that returns an image; an agent's conversations) give each sequence its own images. A vision-language
run that rl2 cannot train (a text-only critic or teacher) is refused before any model loads."""

import base64
import io

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from conftest import run_torchrun
from rl2.chat.tool_parsers import get_tool_parser
from rl2.config import ConfigError, DataConfig, load_config
from rl2.distributed.packing import plan_grouped_micro_batches
from rl2.engines import HFEngine, SamplingParams
from rl2.rollout.agent_rollout import AgentFile, agent_rollout
from rl2.rollout.env import Env
from rl2.rollout.images import RolloutImages
from rl2.rollout.multi_turn import rollout
from rl2.trainer.ppo import check_vision_run
from rl2.vision.image_inputs import ImageInputs
from rl2.serve.openai_server import OpenAIServer
from rl2.vision.inputs import build_vision_sample, text_messages
from rl2.vision.processing import ImageProcessing
from scripted_engine import ScriptedEngine

WORKER = "tests/workers/vision_ppo_step.py"
GROUP_SIZE = 2
ARGS = [f"data.responses_per_prompt={GROUP_SIZE}", "adv.estimator=reinforce", "adv.norm_var=true",  # GRPO
        "actor.lr=1e-2", "actor.warmup_ratio=0", "actor.proximal_from_update=false", "actor.max_length_per_device=512"]


def trajectories(model_dir: str) -> list[dict]:
    """Two groups of two: the first group's prompts hold images (two of different sizes, then one), the
    second group's none; responses are random tokens, rewards differ within each group."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    images = [Image.new("RGB", (56, 56), (200, 30, 30)), Image.new("RGB", (84, 56), (30, 30, 200))]
    prompts = [
        {"messages": [{"role": "user", "content": "<image> and <image>: which is red?"}], "images": images},
        {"messages": [{"role": "user", "content": "<image> what colour?"}], "images": images[1:]},
        {"messages": [{"role": "user", "content": "say a word"}], "images": []},
        {"messages": [{"role": "user", "content": "say another word please"}], "images": []},
    ]
    generator = torch.Generator().manual_seed(0)
    batch = []
    for i, row in enumerate(prompts):
        sample = build_vision_sample(row, i, tokenizer, processor, add_generation_prompt=True)
        prompt = sample["input_ids"].tolist()
        response = torch.randint(10, 900, ([6, 8, 60, 4][i],), generator=generator).tolist()
        has_images = "pixel_values" in sample
        batch.append({
            "token_ids": prompt + response, "action_mask": [0] * len(prompt) + [1] * len(response),
            "logprobs": [0.0] * (len(prompt) + len(response)), "reward": [1.0, 0.0, 0.0, 1.0][i], "group": i // 2,
            "images": {"pixel_values": sample["pixel_values"], "image_grid_thw": sample["image_grid_thw"]}
            if has_images else None,
        })
    return batch


def run_step(model_dir, tmp_path, nproc: int, *extra: str) -> dict:
    batch, out = tmp_path / f"batch_{nproc}.pt", tmp_path / f"out_{nproc}.pt"
    torch.save(trajectories(model_dir), batch)
    run_torchrun([WORKER, model_dir, str(batch), str(out), *ARGS, *extra], nproc=nproc, timeout=300)
    return {**torch.load(out, weights_only=False), "critic_dir": f"{out}.critic"}


def reference_and_teacher(model_dir: str) -> list[str]:
    """A KL loss to the reference and a distillation loss to a teacher, both vision-language models (the
    starting model: every KL term starts at 0, but each model's log-probs are computed with the images)."""
    return ["kl.coef=0.01", "kl.type=loss", f"teacher.model_name={model_dir}", "distill.coef=0.1", "distill.mode=loss"]


@pytest.fixture(scope="module")
def one_rank(vlm_dir, tmp_path_factory) -> dict:
    return run_step(vlm_dir, tmp_path_factory.mktemp("one"), 1, *reference_and_teacher(vlm_dir))


@pytest.fixture(scope="module")
def two_ranks(vlm_dir, tmp_path_factory) -> dict:
    return run_step(vlm_dir, tmp_path_factory.mktemp("two"), 2, *reference_and_teacher(vlm_dir))


def hf_logps(model_dir: str, trajectory: dict) -> torch.Tensor:
    """log p(token t | tokens before t) of the sequence alone with its images, from transformers' own forward."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.tensor([trajectory["token_ids"]])
    images = trajectory["images"] or {}
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).long(), **images).logits[0]
    logps = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logps])


def test_the_batch_has_images_on_one_rank_only(vlm_dir):
    batch = trajectories(vlm_dir)
    plan = plan_grouped_micro_batches([len(t["token_ids"]) for t in batch], 1, 2, 512)
    with_images = [any(batch[i]["images"] is not None for row in rank for i in row) for rank in plan]
    assert sorted(with_images) == [False, True]


def test_old_reference_and_teacher_logps_equal_each_sequence_alone_with_its_images(one_rank, vlm_dir):
    batch = trajectories(vlm_dir)
    outputs = zip(one_rank["old_logps"], one_rank["ref_logps"], one_rank["teacher_logps"])
    for trajectory, (old, ref, teacher) in zip(batch, outputs):
        mask = torch.tensor(trajectory["action_mask"], dtype=torch.bool)
        expected = hf_logps(vlm_dir, trajectory)
        for logps in (old, ref, teacher):
            torch.testing.assert_close(logps[mask], expected[mask], rtol=0, atol=1e-5)
        assert (old[~mask] == 0).all()
    # With other pixels the log-probs are others: the equality above holds because the images are read.
    images = batch[0]["images"]
    blank = hf_logps(vlm_dir, {**batch[0], "images": {**images, "pixel_values": torch.zeros_like(images["pixel_values"])}})
    mask = torch.tensor(batch[0]["action_mask"], dtype=torch.bool)
    assert (blank[mask] - one_rank["old_logps"][0][mask]).abs().max() > 1e-3


def test_two_ranks_one_without_images_update_as_one_rank(one_rank, two_ranks):
    assert one_rank["grads"].keys() == two_ranks["grads"].keys()
    for name, grad in one_rank["grads"].items():
        torch.testing.assert_close(two_ranks["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    for name in ("actor/loss", "actor/grad_norm", "actor/kl_loss", "actor/distill_loss", "advantage/mean"):
        assert two_ranks["metrics"][name] == pytest.approx(one_rank["metrics"][name], rel=1e-5, abs=1e-7), name
    assert one_rank["metrics"]["actor/loss_tokens"] == two_ranks["metrics"]["actor/loss_tokens"]


def test_sequence_parallel_steps_as_one_rank(one_rank, vlm_dir, tmp_path):
    """actor.sp_size=2 on 2 ranks: the batch in one row of each model (policy, reference, teacher), split over
    both ranks after the images are merged; the old, reference and teacher log-probs and the update are one
    rank's."""
    sp = run_step(vlm_dir, tmp_path, 2, "actor.sp_size=2", *reference_and_teacher(vlm_dir))
    for key in ("old_logps", "ref_logps", "teacher_logps"):
        for ours, expected in zip(sp[key], one_rank[key], strict=True):
            torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5, msg=key)
    assert one_rank["grads"].keys() == sp["grads"].keys()
    for name, grad in one_rank["grads"].items():
        torch.testing.assert_close(sp["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    for name in ("actor/loss", "actor/grad_norm", "actor/kl_loss", "actor/distill_loss", "actor/loss_tokens"):
        assert sp["metrics"][name] == pytest.approx(one_rank["metrics"][name], rel=1e-5, abs=1e-7), name


def test_old_logps_from_the_update_pass_step_as_from_their_own_pass(one_rank, vlm_dir, tmp_path):
    """The default proximal_from_update=true (the batch trains once: its forward pass gives the old log-probs).
    At the first update the reference and the teacher equal the policy, so their KL losses add no gradient: the
    gradients are those of the run with them."""
    default = run_step(vlm_dir, tmp_path, 1, "actor.proximal_from_update=true")
    assert default["old_logps"] == [None] * 4  # not computed before the update
    for name, grad in one_rank["grads"].items():
        torch.testing.assert_close(default["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_vision_tower_is_frozen_and_the_text_model_trains(one_rank):
    before, after = one_rank["before"], one_rank["after"]
    visual = [name for name in before if ".visual." in name or name.startswith("visual.")]
    text = [name for name in before if ".language_model." in name and ".layers." in name]
    assert visual and text
    assert all(torch.equal(before[name], after[name]) for name in visual)
    assert all(not torch.equal(before[name], after[name]) for name in text)


def test_lora_on_two_ranks_trains_the_text_models_adapters_against_the_base_as_reference(vlm_dir, tmp_path):
    run = run_step(vlm_dir, tmp_path, 2, "actor.lora.rank=4", "kl.coef=0.01", "kl.type=loss")
    changed = [name for name in run["before"] if not torch.equal(run["before"][name], run["after"][name])]
    assert len(changed) == 28 and all("lora_" in name and ".language_model." in name for name in changed)
    for old, ref in zip(run["old_logps"], run["ref_logps"]):  # the adapters start as a no-op
        assert torch.equal(old, ref)


def hf_values(model_dir: str, score: dict[str, torch.Tensor], trajectory: dict) -> torch.Tensor:
    """The critic's values of the sequence alone with its images: the head `score` over the last hidden states of
    transformers' own image-text-to-text model's backbone; value[t] is the head's output at t - 1, 0 at t = 0."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.tensor([trajectory["token_ids"]])
    images = trajectory["images"] or {}
    with torch.no_grad():
        hidden = model.model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).long(),
                             **images).last_hidden_state[0]
    out = hidden @ score["score.weight"][0] + score["score.bias"][0]
    return torch.cat([torch.zeros(1), out[:-1]])


@pytest.fixture(scope="module")
def with_critic(vlm_dir, tmp_path_factory) -> dict:
    """A GAE step with a vision-language critic (the actor's model with a fresh value head) on one rank: its
    rows mix sequences with and without images."""
    return run_step(vlm_dir, tmp_path_factory.mktemp("critic"), 1, "adv.estimator=gae", "critic.lr=1e-2",
                    "critic.warmup_ratio=0", "critic.max_length_per_device=512")


def test_critic_values_equal_each_sequence_alone_with_its_images(with_critic, vlm_dir):
    batch = trajectories(vlm_dir)
    score = {name: with_critic["critic_before"][name] for name in ("score.weight", "score.bias")}
    for trajectory, values in zip(batch, with_critic["old_values"]):
        torch.testing.assert_close(values, hf_values(vlm_dir, score, trajectory), rtol=0, atol=1e-5)
    images = batch[0]["images"]  # the values read the images
    blank = {**images, "pixel_values": torch.zeros_like(images["pixel_values"])}
    blank = hf_values(vlm_dir, score, {**batch[0], "images": blank})
    assert (blank - with_critic["old_values"][0]).abs().max() > 1e-4


def test_the_critic_trains_its_text_model_and_head_and_reloads_to_the_same_values(with_critic):
    before = with_critic["critic_before"]
    metrics = with_critic["metrics"]
    assert metrics["critic/grad_norm"] > 0 and "critic/loss" in metrics
    visual = [name for name in before if ".visual." in name]
    assert visual and "score.weight" in before and "lm_head.weight" not in before
    saved = load_file(f"{with_critic['critic_dir']}/model.safetensors")
    assert saved.keys() == before.keys()  # transformers' names: model.visual.*, model.language_model.*, score.*
    assert all(torch.equal(before[name], saved[name]) for name in visual)  # critic.freeze_vision (default on)
    assert not torch.equal(before["score.weight"], saved["score.weight"])
    assert any(not torch.equal(before[name], saved[name]) for name in before if ".language_model.layers." in name)
    for after, reloaded in zip(with_critic["values_after"], with_critic["values_reloaded"]):
        torch.testing.assert_close(reloaded, after, rtol=0, atol=1e-6)
    assert any(not torch.equal(old, new) for old, new in zip(with_critic["old_values"], with_critic["values_after"]))


TOOL_ENV = """
from PIL import Image

def interact(messages):
    if "look" in messages[-1]["content"]:
        return [{"role": "user", "content": [{"type": "text", "text": "here:"},
                                             {"type": "image", "image": Image.new("RGB", (84, 56), (0, 0, 255))}]}]
    return []

def reward_fn(messages, answer):
    return 0.0
"""


class ImageScriptedEngine(ScriptedEngine):
    """Scripted replies (`ScriptedEngine`) to prompts that hold images."""

    def generate(self, prompts, params, images=None):
        return super().generate(prompts, params)


def per_turn_trajectories(model_dir: str, tmp_path) -> list[dict]:
    """Two groups of two per-turn trajectories of two turns, from a rollout whose tool returns an image: the first
    group's prompt holds an image (its turns' sequences hold 1, then 2 images), the second's none (0, then 1)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    red = Image.new("RGB", (56, 56), (200, 30, 30))
    rows = [{"messages": [{"role": "user", "content": "<image> what colour?"}], "images": [red], "answer": "r"},
            {"messages": [{"role": "user", "content": "say a word"}], "images": [], "answer": "w"}]
    env_path = tmp_path / "env.py"
    env_path.write_text(TOOL_ENV)
    images = RolloutImages.for_model(model_dir, DataConfig(), tokenizer)
    samples = [build_vision_sample(row, i, tokenizer, images.processing.image_processor, add_generation_prompt=True)
               for i, row in enumerate(rows)]
    prompts = [{"prompt_ids": sample["input_ids"].tolist(), "images": ImageInputs.of_sample(sample),
                "messages": text_messages(row["messages"], row["images"], "test")[0], "answer": row["answer"]}
               for row, sample in zip(rows, samples)]
    engine = ImageScriptedEngine(tokenizer, lambda text: "blue sky" if "here:" in text else "look")
    with Env(str(env_path), need_interact=True) as env:
        rolled = rollout(engine, env, tokenizer, prompts, GROUP_SIZE, SamplingParams(temperature=0.0, max_new_tokens=8),
                         max_turns=2, images=images, per_turn=True)
    images.close()
    for i, t in enumerate(rolled):
        assert t.errors == [] and t.turn_images == ([[0, 1], [0, 2]] if i < 2 else [[0, 0], [0, 1]])
    return batch_of(rolled)


def batch_of(rolled: list) -> list[dict]:
    """The fields of rolled-out trajectories that the step worker reads, rewards differing within each group."""
    return [{"token_ids": t.token_ids, "action_mask": t.action_mask, "logprobs": t.logprobs,
             "reward": [1.0, 0.0, 0.0, 1.0][i], "group": t.group, "turn_starts": t.turn_starts,
             "turn_images": t.turn_images,
             "images": {"pixel_values": t.images.pixel_values, "image_grid_thw": t.images.image_grid_thw}}
            for i, t in enumerate(rolled)]


def assert_each_sequence_scores_as_alone_with_its_images(model_dir: str, batch: list[dict], tmp_path, *extra: str):
    """A step on `batch` (several sequences per trajectory) trains, and each sequence's old log-probs are those of
    transformers' own forward of that sequence alone with the images `turn_images` gives it."""
    torch.save(batch, tmp_path / "batch.pt")
    out = tmp_path / "out.pt"
    run_torchrun([WORKER, model_dir, str(tmp_path / "batch.pt"), str(out), *ARGS, *extra], nproc=1, timeout=300)
    result = torch.load(out, weights_only=False)
    assert result["metrics"]["actor/grad_norm"] > 0
    for trajectory, old in zip(batch, result["old_logps"]):
        bounds = [*trajectory["turn_starts"], len(trajectory["token_ids"])]
        grid, pixels = trajectory["images"]["image_grid_thw"], trajectory["images"]["pixel_values"]
        for start, end, (first, count) in zip(bounds, bounds[1:], trajectory["turn_images"]):
            patches = grid.prod(-1).cumsum(0).tolist()
            begin = patches[first - 1] if first else 0
            images = {"pixel_values": pixels[begin:patches[first + count - 1] if count else begin],
                      "image_grid_thw": grid[first:first + count]}
            sequence = {"token_ids": trajectory["token_ids"][start:end], "images": images if count else None}
            mask = torch.tensor(trajectory["action_mask"][start:end], dtype=torch.bool)
            assert mask.any()
            torch.testing.assert_close(old[start:end][mask], hf_logps(model_dir, sequence)[mask], rtol=0, atol=1e-5)


def test_per_turn_sequences_with_tool_images_have_the_logps_of_each_sequence_alone_with_its_images(vlm_dir, tmp_path):
    """rollout.trajectory_format=per_turn with a tool that returns an image: each turn's sequence (the conversation
    so far) is scored with the images it holds (`turn_images[k]`: the first 1 or 2 of the trajectory's), as
    transformers' own forward of that sequence alone with them gives; the step trains."""
    assert_each_sequence_scores_as_alone_with_its_images(vlm_dir, per_turn_trajectories(vlm_dir, tmp_path), tmp_path,
                                                         "rollout.trajectory_format=per_turn")


AGENT = """
async def run(row, client):
    for content in row["requests"]:  # each a new conversation: a sequence of its own
        await client.chat.completions.create(model="rl2", messages=[{"role": "user", "content": content}],
                                             max_tokens=4)
    return 1.0
"""


def data_uri(colour) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 84), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_an_agents_sequences_with_images_have_the_logps_of_each_sequence_alone_with_its_images(vlm_dir, tmp_path):
    """An agent file's requests with `image_url` data URIs through rl2's OpenAI server (the `hf` engine): each of
    its conversations is a sequence of its trajectory holding its own images (`turn_images`: the first, then the
    second image; for a group whose first conversation has none: none, then the first); a step on them scores
    each sequence as transformers' forward of it alone with its images."""
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    red, blue = data_uri((200, 30, 30)), data_uri((30, 30, 200))
    image = lambda uri, text: [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}]
    rows = [{"requests": [image(red, "what colour?"), image(blue, "and this one?")]},
            {"requests": ["say a word", image(blue, "what is this?")]}]
    prompts = [{"messages": [], "prompt_ids": [1], "row": row} for row in rows]
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    server = OpenAIServer(tokenizer, image_processing=ImageProcessing.from_pretrained(vlm_dir))
    try:
        rolled = agent_rollout(server, HFEngine(vlm_dir, tokenizer, torch.device("cpu")), AgentFile(str(agent)),
                               tokenizer, get_tool_parser("hermes"), prompts, GROUP_SIZE,
                               SamplingParams(temperature=1.0, max_new_tokens=4), 8, 4096)
    finally:
        server.close()
    for i, t in enumerate(rolled):
        assert t.errors == [] and len(t.turn_starts) == 2
        assert t.turn_images == ([[0, 1], [1, 1]] if i < 2 else [[0, 0], [0, 1]])
    assert_each_sequence_scores_as_alone_with_its_images(vlm_dir, batch_of(rolled), tmp_path)


def test_runs_rl2_cannot_train_with_images_yet_are_refused(vlm_dir, tiny_model_dir):
    base = [f"actor.model_name={vlm_dir}"]
    for extra, words in ((["adv.estimator=gae", f"critic.model_name={tiny_model_dir}"], "critic"),
                         ([f"teacher.model_name={tiny_model_dir}", "distill.coef=1"], "text-only"),
                         (["adv.estimator=gae", "critic.sp_size=2"], "critic.sp_size=1")):
        with pytest.raises(ConfigError, match=words):
            check_vision_run(load_config([*base, *extra], "ppo"))
    check_vision_run(load_config(base, "ppo"))
    check_vision_run(load_config([*base, "adv.estimator=gae"], "ppo"))  # the actor's model as critic
    check_vision_run(load_config([*base, "rollout.trajectory_format=per_turn"], "ppo"))
    check_vision_run(load_config([f"actor.model_name={tiny_model_dir}"], "ppo"))


def test_the_image_keys_are_ppo_keys():
    for key in ("data.image_key=pics", "data.min_pixels=100", "data.max_pixels=1000", "actor.freeze_vision=false"):
        load_config([key], "ppo")
