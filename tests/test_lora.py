"""LoRA (`actor.lora.rank` > 0, rl2.lora): only the adapters train, a step equals a plain peft model's step
and 1 rank equals 2 (and sequence parallelism with chunked log-probs), the reference is the base model, the
engine after a sync (only the merged adapted weights sent) gives the actor's log-probs, the saved adapter
loads with peft and the merged export is the merged model; trainers run with it."""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import run_demo, run_python, run_torchrun
from rl2.algorithms.losses import with_loss_weights
from rl2.lora import add_lora
from rl2.metrics import read_metrics
from rl2.workers.policy import token_logps

WORKER = "tests/workers/lora_step.py"


def _logps(model, sequence: dict) -> torch.Tensor:
    ids = sequence["input_ids"][None]
    logits = model(input_ids=ids).logits
    return token_logps(logits, ids, torch.arange(ids.shape[1])[None])[0]


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    run_python([WORKER, tiny_model_dir, str(folder / "one.pt"), str(folder / "saved")])
    return torch.load(folder / "one.pt", weights_only=False), str(folder / "saved")


@pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins
def test_only_the_adapters_train_and_their_state_is_adapter_sized(one_rank):
    result, _ = one_rank
    before, after = result["before"], result["after"]
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    adapters = {name for name in before if ".lora_" in name}
    assert changed == {name for name in adapters if ".lora_B." in name} | {name for name in adapters if ".lora_A." in name}
    assert set(result["trainable"]) == adapters  # base weights bit-identical, frozen
    assert result["optimizer_numel"] == sum(before[name].numel() for name in adapters)
    assert result["optimizer_numel"] < 0.05 * sum(t.numel() for t in before.values())


@pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins
def test_a_lora_step_is_a_plain_peft_step(one_rank, tiny_model_dir):
    """The same micro-batches through a peft model in plain torch, AdamW with the same settings: the same
    adapters after the step."""
    result, _ = one_rank
    model = add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), result_lora())
    state = model.state_dict()
    for name, value in result["before"].items():  # the same start, adapters included
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    loss = sum(-(_logps(model, seq) * seq["loss_weight"]).sum() for seq in with_loss_weights(result["batch"]))
    loss.backward()
    optimizer.step()
    assert loss.item() == pytest.approx(result["metrics"]["loss"], rel=1e-5)
    state = model.state_dict()
    for name in result["trainable"]:
        torch.testing.assert_close(result["after"][name], state[name], rtol=1e-4, atol=1e-6, msg=name)


def result_lora():
    from rl2.config import LoraConfig

    return LoraConfig(rank=4, alpha=8.0)


@pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins
def test_reference_is_the_base_model(one_rank, tiny_model_dir):
    result, _ = one_rank
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for sequence, before, after in zip(result["batch"], result["ref_before"], result["ref_after"]):
            expected = _logps(base, sequence) * sequence["loss_mask"]  # the policy's log-probs at its loss tokens
            assert (before - expected).abs().max() < 1e-5 and torch.equal(before, after)


@pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins
def test_engine_after_a_sync_gives_the_actors_logprobs(one_rank):
    """Only the adapted layers' merged weights are sent (the embedded engine kept the rest)."""
    result, _ = one_rank
    assert result["sent"] and all(name.endswith(".base_layer.weight") for name in result["sent"])
    assert len(result["sent"]) == len([n for n in result["trainable"] if ".lora_A." in n])
    for engine, actor in zip(result["engine_logps"], result["actor_logps"]):
        assert (engine - actor).abs().max() < 1e-5


@pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins
def test_saved_adapter_loads_with_peft_and_merged_export_is_the_merged_model(one_rank, tiny_model_dir):
    from peft import PeftModel

    result, saved = one_rank
    assert json.load(open(os.path.join(saved, "adapter_config.json")))["r"] == 4
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, saved).eval()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(saved, "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        for sequence, logps in zip(result["batch"], result["logps"]):
            mask = sequence["loss_mask"]  # the policy's log-probs are its loss tokens'
            assert (_logps(peft_model, sequence) * mask - logps).abs().max() < 1e-5
            assert (_logps(merged, sequence) * mask - logps).abs().max() < 1e-5


@pytest.mark.parametrize("sp_size, chunk", [(1, 0), (2, 5)], ids=["data-parallel", "sequence-parallel-chunked"])
def test_two_ranks_equal_one(one_rank, tiny_model_dir, tmp_path, sp_size, chunk):
    result, _ = one_rank
    run_torchrun([WORKER, tiny_model_dir, str(tmp_path / "two.pt"), str(tmp_path / "saved"), str(sp_size), str(chunk)])
    two = torch.load(tmp_path / "two.pt", weights_only=False)
    assert two["metrics"]["loss"] == pytest.approx(result["metrics"]["loss"], rel=1e-5)
    for name in result["trainable"]:
        torch.testing.assert_close(two["after"][name], result["after"][name], rtol=1e-4, atol=1e-6, msg=name)
    for name in result["before"]:
        if name not in result["trainable"]:
            assert torch.equal(two["after"][name], result["before"][name]), name


@pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins
def test_bf16_keeps_the_frozen_base_in_bf16_and_the_adapters_in_fp32(tiny_model_dir, tmp_path):
    """actor.dtype=bfloat16: the base weights, which never update, are stored in bf16 (no fp32 master: half
    their memory), the adapters keep fp32 masters; the reference (adapters off) before the step runs first,
    as in a PPO step, and the step still trains only the adapters."""
    run_python([WORKER, tiny_model_dir, str(tmp_path / "bf16.pt"), str(tmp_path / "saved")], env={"LORA_DTYPE": "bfloat16"})
    result = torch.load(tmp_path / "bf16.pt", weights_only=False)
    base = {name: tensor for name, tensor in result["before"].items() if ".lora_" not in name}
    assert {t.dtype for t in base.values()} == {torch.bfloat16}
    assert {result["before"][name].dtype for name in result["trainable"]} == {torch.float32}
    assert all(torch.equal(result["after"][name], tensor) for name, tensor in base.items())
    assert all(not torch.equal(result["after"][name], result["before"][name]) for name in result["trainable"]
               if ".lora_B." in name)
    for engine, actor in zip(result["engine_logps"], result["actor_logps"]):
        assert (engine - actor).abs().max() < 0.05  # a float32 engine against bf16 compute


# ---- trainers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("trainer", ["dpo", "rm"])
def test_dpo_and_rm_train_with_lora_and_resume_exactly(tiny_model_dir, tmp_path, trainer):
    """DPO (its reference: the actor with adapters off) and the reward model (its `score` head trained whole)
    learn with LoRA on 2 ranks, save the adapter in peft's format, and a run resumed from step 4 repeats
    steps 5-8."""
    import shutil

    from test_rm_dpo import SECTION, TIMING_KEYS, pair_args

    data = str(tmp_path / "pairs")
    run_python(["recipes/make_pair_data.py", data, "--rows", "64", "--test-rows", "16"])
    section = SECTION[trainer]
    lora = (f"{section}.lora.rank=8", f"{section}.lora.alpha=16", f"{section}.lr=1e-2")
    straight = tmp_path / "straight"
    run_torchrun(pair_args(trainer, tiny_model_dir, data, str(straight), 8, f"{section}.save_freq=4", *lora))
    rows = read_metrics(str(straight / "metrics.jsonl"))
    tests = [row for row in rows if "test/accuracy" in row]
    assert tests[-1]["test/accuracy"] > tests[0]["test/accuracy"], tests
    assert os.path.exists(straight / "step8" / "adapter_config.json")
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "step4", resumed / "step4")
    run_torchrun(pair_args(trainer, tiny_model_dir, data, str(resumed), 8, "trainer.load_ckpt_from=latest", *lora))
    again = read_metrics(str(resumed / "metrics.jsonl"))
    assert [row["step"] for row in again] == [5, 6, 7, 8]
    for ours, theirs in zip(again, [row for row in rows if row["step"] >= 5]):
        for key in ours.keys() - TIMING_KEYS:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (ours["step"], key)


TOOL_ENV = """
def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)


def interact(messages):  # a tool that answers every first turn
    return [{"role": "tool", "content": "more"}] if sum(m["role"] == "assistant" for m in messages) < 2 else []
"""


def test_ppo_with_lora_actor_critic_kl_and_tools(tiny_model_dir, tmp_path):
    """GAE with a LoRA actor and a LoRA critic, the KL reference being the actor with adapters off, a
    multi-turn env, on 2 ranks: the engine holds the merged weights after every sync (its log-probs are the
    actor's), and the KL to the base model grows from 0."""
    from test_ppo import _ppo_args

    data = str(tmp_path / "data")
    run_python(["recipes/make_demo_data.py", "--task", "successor", "--out", data, "--rows", "64", "--test-rows", "8"])
    env = tmp_path / "tool_env.py"
    env.write_text(TOOL_ENV)
    save_dir = tmp_path / "run"
    run_torchrun(_ppo_args(tiny_model_dir, data, str(save_dir), f"rollout.env_path={env}",
                           "rollout.max_turns=2", "adv.estimator=gae", "actor.lora.rank=8", "actor.lora.alpha=16",
                           "critic.lora.rank=8", "actor.lr=1e-2", "kl.coef=0.01", "kl.type=loss",
                           "rollout.dynamic_filtering=false", "trainer.test_freq=null"))
    rows = read_metrics(str(save_dir / "metrics.jsonl"))
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert all(row["logp_mismatch/max"] < 1e-4 for row in rows)  # the engine generates with the merged weights
    assert rows[0]["kl"] == pytest.approx(0, abs=1e-6) and abs(rows[-1]["kl"]) > 1e-4  # to the base: 0 before training
    assert max(row["turns/mean"] for row in rows) > 1  # answers that stop (not cut at the length) get a tool turn
    assert os.path.exists(save_dir / "step4" / "adapter_config.json")
    assert os.path.exists(save_dir / "step4" / "critic" / "adapter_config.json")


@pytest.mark.xdist_group("demo_warmup")
@pytest.mark.parametrize("seed", [42])  # seed 10 passed as well in every suite run to 2026-11-26: one keeps it short
def test_demo_learns_with_lora(tmp_path, seed, demo_warmup):
    """The README's GRPO demo with a rank-16 LoRA actor (lr 10x the full-tuning demo's, as LoRA wants) learns
    on one rank from the full-tuning demo test's warm-up: reward from ~0.1 to >= 0.7 in 20 steps."""
    from conftest import REPO
    from rl2.testing.tiny import save_tiny

    save_tiny(str(tmp_path / "model"), hidden_size=128, num_layers=2)
    env = {**os.environ, "OUT": str(tmp_path), "SFT_CKPT": demo_warmup(seed), "PPO_STEPS": "20", "NPROC": "1",
           "SEED": str(seed), "PYTHONPATH": REPO}
    result = run_demo(["trainer.test_freq=null", "trainer.dump_trajectories=false", "actor.lora.rank=16",
                       "actor.lora.alpha=32", "actor.lr=5e-3"], env)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = read_metrics(str(tmp_path / "ppo" / "metrics.jsonl"))
    rewards = [row["reward/mean"] for row in rows]
    assert len(rewards) == 20 and rewards[0] < 0.3
    assert sum(rewards[-3:]) / 3 >= 0.7, rewards
    assert max(row["logp_mismatch/max"] for row in rows) < 1e-3  # the engine has the merged weights
    assert os.path.exists(tmp_path / "ppo" / "step20" / "adapter_model.safetensors")


def test_grpo_roc_with_lora(tiny_model_dir, tmp_path):
    """GRPO-RoC (oversampled groups, top-k kept by the env's penalty) with a LoRA actor on 2 ranks."""
    from test_ppo import ROC_ENV, _ppo_args

    data = str(tmp_path / "data")
    run_python(["recipes/make_demo_data.py", "--task", "successor", "--out", data, "--rows", "64", "--test-rows", "8"])
    env = tmp_path / "roc_env.py"
    env.write_text(f"LOG = {str(tmp_path / 'calls.txt')!r}\n" + ROC_ENV)
    save_dir = tmp_path / "run"
    run_torchrun(_ppo_args(tiny_model_dir, data, str(save_dir), f"rollout.env_path={env}", "data.responses_per_prompt=2",
                           "rollout.oversample=4", "adv.resample_on_correct=true", "adv.roc_mode=topk",
                           "adv.roc_min_each=1", "trainer.total_steps=2", "trainer.test_freq=null",
                           "actor.lora.rank=8", "actor.lr=1e-2"))
    rows = read_metrics(str(save_dir / "metrics.jsonl"))
    assert [row["step"] for row in rows] == [1, 2] and all(row["trajectories"] == 16.0 for row in rows)
    assert all(row["logp_mismatch/max"] < 1e-4 for row in rows)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_merged_weights_of_a_mixture_of_experts_model_are_peft_merged_ones(family):
    """all-linear on a mixture-of-experts model: peft adapts the router and the stacked experts' weights too
    (Qwen3-MoE; gpt-oss: the attention alone), one wrapper per parameter, nested. The merged state dict (what
    the engine and the merged export get) is peft's merge_and_unload's, every key under the base model's name,
    and the merged model computes as the peft model does."""
    import copy

    from rl2.config import LoraConfig
    from rl2.lora import adapted_weights, merged_state_dict
    from rl2.testing.tiny_moe import build_tiny_moe

    model = add_lora(build_tiny_moe(family).float(), LoraConfig(rank=4, alpha=8))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: adapters that change something
                parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(len(name))))
    adapted = adapted_weights(model)
    if family == "qwen3_moe":
        assert {key.rsplit(".", 1)[-1] for key in adapted} >= {"gate_up_proj", "down_proj", "weight"}
        assert any(".mlp.gate." in key for key in adapted)  # the router
    merged = merged_state_dict(model.state_dict(), adapted)
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert sorted(merged) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-5, atol=1e-5, msg=key)
    base = build_tiny_moe(family).float()
    base.load_state_dict(merged)
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
