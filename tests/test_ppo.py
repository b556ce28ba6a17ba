"""The PPO trainer: world-size invariance, weight sync, the demo learning, exact resume, start-up errors."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import GRAD_RTOL, REPO, assert_same_gradients, run_demo, run_python, run_torchrun
from docs_blocks import assert_metrics_documented
from rl2.metrics import read_metrics
from rl2.testing.tiny import save_tiny

WORKER = "tests/workers/ppo_update.py"


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("rl_data"))
    run_python(["recipes/make_demo_data.py", "--task", "successor", "--out", out, "--rows", "64", "--test-rows", "8"])
    return out


@pytest.mark.parametrize(
    "estimator,two_rank_overrides",
    [("grpo", []), ("gae", []), ("gae", ["actor.sp_size=2", "critic.sp_size=2"]), ("gspo-icepop", []),
     ("cispo-geo-mis", ["actor.sp_size=2"]), ("dr-grpo", [])],
    ids=["grpo", "gae", "gae-sequence-parallel", "gspo-icepop", "cispo-geo-mis-sequence-parallel", "dr-grpo"],
)
def test_update_is_world_size_invariant_and_sync_matches(
    tiny_model_dir, rl_data, tmp_path, estimator, two_rank_overrides
):
    """The same rollout gives the same gradients at each of the update's optimizer steps, and the same
    parameters, on 1 and 2 ranks (2 data-parallel ranks, or one sequence-parallel pair); after the
    sync the engine's log-probs equal the actor's. The worker steps with SGD, not AdamW: AdamW turns
    rounding in a near-zero gradient into a step of up to lr, which the next minibatch's gradients
    and the parameters would show differently on every processor (see the worker's docstring)."""
    args = [WORKER, tiny_model_dir, f"{rl_data}/train.jsonl", "envs/demo_successor.py"]
    run_python([*args, str(tmp_path / "one.pt"), estimator])
    run_torchrun([*args, str(tmp_path / "two.pt"), estimator, *two_rank_overrides])
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    models = ["actor", "critic"] if estimator == "gae" else ["actor"]
    assert [name for name in ("actor", "critic") if name in one] == models
    for name in models:
        assert len(one[name]["steps"]) == len(two[name]["steps"]) == 2  # update_per_rollout=2: two minibatches
        for one_step, two_step in zip(one[name]["steps"], two[name]["steps"]):
            assert two_step["lr"] == one_step["lr"]
            assert_same_gradients(two_step["grads"], one_step["grads"])
        _assert_same_sgd_update(one[name], two[name])
    moved = max((one["actor"]["after"][k] - v).abs().max().item() for k, v in one["actor"]["before"].items())
    assert moved > 1e-2, "the update did not change the actor"
    for key, value in one["metrics"].items():
        # Sums over the same tokens (grad_norm: over the gradients) in another order: float32 rounding,
        # ~1e-6 relative. A token whose ratio (or value) sits within rounding of the clip boundary may
        # flip: one token's weight in a minibatch (the critic's hold 56 tokens: 1/56 = 0.018).
        tolerance = 0.02 if "clip_ratio" in key else 1e-6
        assert two["metrics"][key] == pytest.approx(value, rel=1e-4, abs=tolerance), key
    # The engine's forward and the actor's packed one on the same weights: float32 rounding of log-probs
    # of magnitude ~7 (a 1024-token vocabulary), ~1e-6.
    assert one["sync_max_diff"] < 1e-4 and two["sync_max_diff"] < 1e-4


def _assert_same_sgd_update(one: dict, two: dict) -> None:
    """Parameters after SGD steps θ ← θ − lr·g from the same start: each step rounds θ to half its
    float32 spacing (2^-24 |θ|) and passes on the gradients' difference (≤ GRAD_RTOL of their scale)."""
    for name, before in one["before"].items():
        if name not in one["steps"][0]["grads"]:
            continue  # lm_head.weight: tied to the embedding, checked there
        largest = max(before.abs().max().item(), one["after"][name].abs().max().item())
        rounding = len(one["steps"]) * 2**-24 * largest
        carried = sum(step["lr"] * GRAD_RTOL * step["grads"][name].abs().max().item() for step in one["steps"])
        torch.testing.assert_close(two["after"][name], one["after"][name], rtol=0, atol=rounding + carried, msg=name)


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    """The model recipes/ppo_tiny.sh builds (`python -m rl2.testing.tiny --hidden-size 128 --layers 2`), built
    once for the demo runs here (it is deterministic)."""
    return save_tiny(str(tmp_path_factory.mktemp("demo") / "model"), hidden_size=128, num_layers=2)


@pytest.mark.xdist_group("demo_warmup")
@pytest.mark.parametrize("seed", [10, 42])
def test_demo_learns_on_every_seed(tmp_path, seed, demo_model, demo_warmup):
    """The short version of bench/demo_seeds.py (which sweeps many seeds): the README's demo, on one
    rank, learns (its reward goes from the warm-up's ~0.1 to >= 0.7 in 20 steps), on the two seeds that
    once failed: 42 collapsed to reward 0 at step 3 (full-lr Adam steps, no warm-up) and 10's SFT
    warm-up stalled (same cause)."""
    env = {**os.environ, "OUT": str(tmp_path), "SFT_CKPT": demo_warmup(seed), "PPO_STEPS": "20", "NPROC": "1",
           "SEED": str(seed), "PYTHONPATH": REPO}
    shutil.copytree(demo_model, tmp_path / "model")
    result = run_demo(["trainer.test_freq=null", "trainer.dump_trajectories=false"], env)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = read_metrics(str(tmp_path / "ppo" / "metrics.jsonl"))
    rewards = [row["reward/mean"] for row in rows]
    assert len(rewards) == 20
    assert rewards[0] < 0.3
    assert sum(rewards[-3:]) / 3 >= 0.7, rewards
    assert min(rewards) > 0.02, rewards  # never the all-zero state GRPO cannot leave
    assert max(row["logp_mismatch/max"] for row in rows) < 1e-3
    assert "reward/mean by step" in result.stderr
    assert f"report: {tmp_path}/ppo/report.html" in result.stdout and os.path.exists(tmp_path / "ppo" / "report.html")


def _prepared_advantages(overrides: list[str], rewards: list[float | None]) -> list[float]:
    """The advantage that the PPO step's stages (`compute_logps`, then `add_advantages`) give each trajectory
    of a batch with these rewards (None: its reward_fn failed, so it is excluded), under the config
    `overrides`. No model is needed: with recompute_logprobs=false the engine's log-probs are the old ones."""
    from rl2.config import load_config
    from rl2.rollout.trajectory import Trajectory
    from rl2.trainer.ppo_stages import StepModels, add_advantages, compute_logps, sequences_of
    from rl2.trainer.step_plan import StepPlan

    config = load_config(["actor.recompute_logprobs=false", *overrides])
    plan = StepPlan.from_config(config, train_max_new_tokens=8)
    group_size = config.data.responses_per_prompt
    trajectories = [
        Trajectory(messages=[], answer=None, group=i // group_size, token_ids=[5, 6, 7], action_mask=[0, 1, 1],
                   logprobs=[0.0, -0.5, -0.5], reward=reward)
        for i, reward in enumerate(rewards)
    ]
    sequences = sequences_of(trajectories, plan)
    compute_logps(sequences, plan, StepModels(actor=None), step=1)
    add_advantages(sequences, trajectories, plan, step=1)
    assert all(seq["advantages"][0] == 0 and seq["advantages"][1] == seq["advantages"][2] for seq in sequences)
    return [seq["advantages"][-1].item() for seq in sequences]


def test_trainer_baseline_with_one_response_per_prompt_is_the_batch_mean():
    """REINFORCE with data.responses_per_prompt=1 (refused before): the baseline is the mean of the batch's
    scored trajectories (RL2's), here (1 + 0 + 0 + 1) / 4; the failed one gets 0 and is left out."""
    assert _prepared_advantages(["data.responses_per_prompt=1"], [1.0, 0.0, 0.0, 1.0, None]) == pytest.approx(
        [0.5, -0.5, -0.5, 0.5, 0.0])
    std = (4 * 0.25 / 3) ** 0.5
    assert _prepared_advantages(["data.responses_per_prompt=1", "adv.norm_var=true"], [1.0, 0.0, 0.0, 1.0]) == (
        pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5))
    from rl2.config import load_config
    from rl2.config_checks import check_config

    check_config(load_config(["data.path=rows.jsonl", "actor.model_name=Qwen/Qwen2.5-0.5B-Instruct",
                              "rollout.env_path=envs/demo_successor.py", "data.responses_per_prompt=1"]), "ppo")


def test_trainer_applies_adv_global_norm():
    """Groups [1, 0] and [1, 1] with norm_var: per group the second has no signal; with adv.global_norm
    the batch mean 0.75 and the batch std 0.5 apply to all four."""
    overrides = ["data.responses_per_prompt=2", "adv.norm_var=true"]
    rewards = [1.0, 0.0, 1.0, 1.0]
    assert _prepared_advantages(overrides, rewards) == pytest.approx([0.5**0.5, -(0.5**0.5), 0.0, 0.0], rel=1e-5)
    assert _prepared_advantages([*overrides, "adv.global_norm=true"], rewards) == pytest.approx(
        [0.5, -1.5, 0.5, 0.5], rel=1e-5)


def _ppo_args(model_dir: str, data: str, save_dir: str, *extra: str) -> list[str]:
    return [
        "-m", "rl2.trainer.ppo", f"data.path={data}/train.jsonl", f"data.test_path={data}/test.jsonl",
        "data.prompts_per_rollout=4", "data.responses_per_prompt=4", f"actor.model_name={model_dir}",
        "actor.dtype=float32", "actor.lr=1e-3", "actor.gradient_checkpointing=false", f"actor.save_dir={save_dir}",
        "rollout.env_path=envs/demo_successor.py", "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 6}",
        "rollout.test_sampling_params={temperature: 0.0, max_new_tokens: 6}", "adv.norm_var=true",
        "trainer.total_steps=4", "trainer.test_freq=2", "trainer.disable_wandb=true", *extra,
    ]


# The parity of an answer's length: rewards that vary within groups for any model. With env_args.crash_after=N
# the rank's process dies at its N+1th call (env functions in threads: rollout.env_workers=0), as a crash would.
PARITY_ENV = """import os

calls = 0


def reward_fn(messages, answer):
    global calls
    calls += 1
    if calls > int(env_args.get("crash_after", 0)) > 0:
        os._exit(3)
    return float(len(messages[-1]["content"]) % 2)
"""


def _dumped_steps(save_dir: str) -> dict[int, list[dict]]:
    folder = os.path.join(save_dir, "trajectories")
    return {int(name[5:-6]): [json.loads(line) for line in open(os.path.join(folder, name))]
            for name in os.listdir(folder) if name.startswith("step_")}


@pytest.mark.gpu_pins
def test_resume_is_exact(tiny_model_dir, rl_data, tmp_path):
    """4 steps straight equal a run that crashed in step 3 (its checkpoint: step 2) resumed to step 4, on 2
    ranks, in what depends on the data order and on the weights: the prompts each step drew and the rewards
    of its answers (the trajectory dumps), the losses, learning rates and gradient norms, and the final
    weights. Every step trains (the rewards vary within groups) and the prompts of step 3 are not those of
    step 1: a resume that restored nothing, or the weights but not the data order or the optimizer, differs."""
    env_file = tmp_path / "parity_env.py"
    env_file.write_text(PARITY_ENV)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = (f"rollout.env_path={env_file}", "rollout.env_workers=0", "trainer.test_freq=null",
              "rollout.dynamic_filtering=false", "actor.save_freq=2")
    run_torchrun(_ppo_args(tiny_model_dir, rl_data, straight, *common))
    crashed = run_torchrun(_ppo_args(tiny_model_dir, rl_data, resumed, *common, "rollout.env_args.crash_after=16"),
                           check=False)  # 4 prompts x 4 answers a step, 8 scored on each rank
    assert crashed.returncode == 3, crashed.stderr[-3000:]
    assert os.path.exists(f"{resumed}/step2/trainer_state.json") and not os.path.exists(f"{resumed}/step4")
    run_torchrun(_ppo_args(tiny_model_dir, rl_data, resumed, *common, "trainer.load_ckpt_from=latest"))

    a, b = read_metrics(f"{straight}/metrics.jsonl"), read_metrics(f"{resumed}/metrics.jsonl")
    assert [row["step"] for row in a] == [row["step"] for row in b] == [1, 2, 3, 4]
    for row_a, row_b in zip(a, b):
        for key in ("reward/mean", "response_length/mean", "actor/loss", "actor/grad_norm", "actor/lr"):
            assert row_b[key] == pytest.approx(row_a[key], abs=1e-6), (row_a["step"], key)
    assert all(row["actor/grad_norm"] > 1e-3 for row in a)  # every step trains

    dumps_a, dumps_b = _dumped_steps(straight), _dumped_steps(resumed)
    assert sorted(dumps_a) == sorted(dumps_b) == [1, 2, 3, 4]
    prompts = {step: [t["messages"][0]["content"] for t in dump] for step, dump in dumps_a.items()}
    for step in dumps_a:
        assert [t["messages"] for t in dumps_b[step]] == [t["messages"] for t in dumps_a[step]], step
        assert [t["reward"] for t in dumps_b[step]] == [t["reward"] for t in dumps_a[step]], step
    assert prompts[3] != prompts[1] and prompts[4] != prompts[2]  # the data order shows
    assert len({t["reward"] for t in dumps_a[3]}) == 2  # the rewards vary

    final_a = AutoModelForCausalLM.from_pretrained(f"{straight}/step4", dtype=torch.float32).state_dict()
    final_b = AutoModelForCausalLM.from_pretrained(f"{resumed}/step4", dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    assert max((final_a[k] - v).abs().max().item() for k, v in initial.items()) > 1e-3  # training moved them
    for name, value in final_a.items():
        torch.testing.assert_close(final_b[name], value, rtol=0, atol=1e-6, msg=name)


def test_partial_rollout_resumes_exactly(tiny_model_dir, rl_data, tmp_path):
    """Partial rollout on 2 ranks (answers long enough that groups are paused and carried over): the carried
    groups go into the checkpoint, so a run that crashed in step 3 resumed from step 2 equals 4 straight steps
    in the prompts and answers each step trained, the losses, and the final weights; the partial/* metrics say
    that carried-over tokens trained."""
    env_file = tmp_path / "parity_env.py"
    env_file.write_text(PARITY_ENV)
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = (f"rollout.env_path={env_file}", "rollout.env_workers=0", "trainer.test_freq=null",
              "rollout.dynamic_filtering=false", "actor.save_freq=2", "rollout.partial_rollout=true",
              "rollout.partial_extra_prompts=4", "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 24}")
    run_torchrun(_ppo_args(tiny_model_dir, rl_data, straight, *common))
    crashed = run_torchrun(_ppo_args(tiny_model_dir, rl_data, resumed, *common, "rollout.env_args.crash_after=16"),
                           check=False)  # 2 groups of 4 trained on each rank a step (no group is 2 steps old yet)
    assert crashed.returncode == 3, crashed.stderr[-3000:]
    run_torchrun(_ppo_args(tiny_model_dir, rl_data, resumed, *common, "trainer.load_ckpt_from=latest"))

    a, b = read_metrics(f"{straight}/metrics.jsonl"), read_metrics(f"{resumed}/metrics.jsonl")
    assert [row["step"] for row in a] == [row["step"] for row in b] == [1, 2, 3, 4]
    assert_metrics_documented(a)  # partial/*, offpolicy/*
    for row_a, row_b in zip(a, b):
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "partial/resumed_ratio", "partial/carried_groups"):
            assert row_b[key] == pytest.approx(row_a[key], abs=1e-6), (row_a["step"], key)
    assert max(row["partial/resumed_ratio"] for row in a) > 0 and max(row["partial/age_max"] for row in a) >= 1
    dumps_a, dumps_b = _dumped_steps(straight), _dumped_steps(resumed)
    for step in dumps_a:
        assert [t["messages"] for t in dumps_b[step]] == [t["messages"] for t in dumps_a[step]], step
    final_a = AutoModelForCausalLM.from_pretrained(f"{straight}/step4", dtype=torch.float32).state_dict()
    final_b = AutoModelForCausalLM.from_pretrained(f"{resumed}/step4", dtype=torch.float32).state_dict()
    for name, value in final_a.items():
        torch.testing.assert_close(final_b[name], value, rtol=0, atol=1e-6, msg=name)


def test_notebook_run_in_one_process(tiny_model_dir, rl_data, tmp_path):
    """PPOTrainer runs without torchrun, with a critic (GAE), a KL-regularised reference, dynamic
    filtering and an actor frozen for its first step (the critic warms up); its engine sleeps after each
    rollout, and not with rollout.sleep=false."""
    code = (
        "import sys\n"
        "from rl2 import PPOTrainer, load_config\n"
        "trainer = PPOTrainer(load_config(sys.argv[1:]))\n"
        "sleeps, engine_sleep = [], trainer.rollout.engine.sleep\n"
        "trainer.rollout.engine.sleep = lambda: sleeps.append(trainer.step) or engine_sleep()\n"
        "from rl2.metrics import PhaseTimer\n"
        "trainer.config.rollout.sleep = False\n"
        "assert len(trainer.rollout.next_batch(0, trainer.next_prompts, 4, PhaseTimer())[0]) == 16 and sleeps == [], sleeps\n"
        "trainer.config.rollout.sleep = True\n"
        "trainer.train()\n"
        "assert sleeps == [1, 2, 3], sleeps\n"  # rollout.sleep (default): after each step's rollout
        "assert trainer.critic is not None and trainer.reference is not None\n"
        "assert trainer.rollout.engine.max_batch_size == 5\n"  # rollout.max_batch_size: 16 requests in waves of 5 slots
    )
    env_file = tmp_path / "parity_env.py"  # rewards that vary within a group, so not every group is dropped
    env_file.write_text("def reward_fn(messages, answer):\n    return float(len(messages[-1]['content']) % 2)\n")
    args = _ppo_args(tiny_model_dir, rl_data, str(tmp_path / "run"), "adv.estimator=gae", "kl.coef=0.01",
                     "trainer.total_steps=3", "actor.freeze_steps=1", "rollout.dynamic_filtering=true",
                     "rollout.max_batch_size=5",
                     f"rollout.env_path={env_file}")[2:]
    run_python(["-c", code, *args])
    rows = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert [row["step"] for row in rows] == [0, 1, 2, 3] and "test/reward_mean" in rows[0]
    rows = rows[1:]
    assert "test/reward_mean" in rows[-1]
    assert all("dynamic_filter/dropped_ratio" in row for row in rows)
    updated = [row for row in rows if "critic/loss" in row]
    assert updated, "every group was filtered out in every step"
    assert all("kl" in row for row in updated)
    assert "actor/loss" not in rows[0] and ("actor/loss" in rows[-1] or "critic/loss" not in rows[-1])


def test_tool_demo_reward_rises(tmp_path, demo_model):
    """The multi-turn demo, written as a gym-style game (`envs/demo_lookup_gym.py`: make_env, reset/step, scored
    by its step rewards; its env-file twin learns the same, bench/RESULTS.md): the policy learns to call the
    lookup tool, and the reward follows."""
    env = {**os.environ, "OUT": str(tmp_path), "TASK": "lookup", "SFT_STEPS": "200", "PPO_STEPS": "12",
           "PYTHONPATH": REPO}
    shutil.copytree(demo_model, tmp_path / "model")
    result = run_demo(["trainer.test_freq=null", "rollout.env_path=envs/demo_lookup_gym.py"], env)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = read_metrics(str(tmp_path / "ppo" / "metrics.jsonl"))
    first, last = rows[0], rows[-3:]
    assert sum(row["reward/mean"] for row in last) / 3 > first["reward/mean"] + 0.2
    assert sum(row["turns/mean"] for row in last) / 3 > first["turns/mean"] + 0.2
    dump = [json.loads(line) for line in open(tmp_path / "ppo" / "trajectories" / "step_12.jsonl")]
    called = [t for t in dump if t["turns"] == 2]
    assert called and all(t["messages"][2]["role"] == "tool" for t in called)
    # every turn stepped (the last one too), the reward their sum
    assert all(len(t["step_rewards"]) == t["turns"] and t["reward"] == sum(t["step_rewards"]) for t in dump)


@pytest.mark.parametrize(
    "env_text,message",
    [
        ("def reward_fn(messages, answer)\n    return 1.0\n", "line 1"),
        ("def interact(messages):\n    return []\n", "reward_fn"),
    ],
    ids=["syntax-error", "no-reward-fn"],
)
def test_broken_env_file_fails_at_start(tiny_model_dir, rl_data, tmp_path, env_text, message):
    env_file = tmp_path / "env.py"
    env_file.write_text(env_text)
    command = [sys.executable, *_ppo_args(tiny_model_dir, rl_data, str(tmp_path / "run"), f"rollout.env_path={env_file}")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": REPO})
    assert result.returncode == 2
    assert "rl2: error:" in result.stderr and str(env_file) in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr


ROC_ENV = """
def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) % 2)


def roc_penalty(messages):
    with open(LOG, "a") as log:
        log.write("called\\n")
    return float(len(messages[-1]["content"]))
"""


def test_grpo_roc_steps(tiny_model_dir, rl_data, tmp_path):
    """GRPO-RoC on 2 ranks: 4 responses generated per prompt, 2 kept per group that has both a
    positive and a negative, penalties from the env file's roc_penalty; its metrics are logged."""
    env_file = tmp_path / "roc_env.py"
    calls = tmp_path / "roc_calls.txt"
    env_file.write_text(f"LOG = {str(calls)!r}\n" + ROC_ENV)
    save_dir = tmp_path / "run"
    run_torchrun(_ppo_args(tiny_model_dir, rl_data, str(save_dir), f"rollout.env_path={env_file}",
                           "data.responses_per_prompt=2", "rollout.oversample=4", "adv.resample_on_correct=true",
                           "adv.roc_mode=topk", "adv.roc_min_each=1", "trainer.total_steps=2", "trainer.test_freq=null"))
    rows = read_metrics(str(save_dir / "metrics.jsonl"))
    assert [row["step"] for row in rows] == [1, 2]
    assert_metrics_documented(rows)  # roc/*
    for row in rows:
        assert row["trajectories"] == 16.0  # 4 prompts x 4 generated
        assert row["roc/kept_trajectories"] == 2 * (4 - row["roc/dropped_groups"])
        for key in ("tool_error_rate", "format_error_rate"):
            assert 0.0 <= row[f"roc/{key}_before"] <= 1.0 and 0.0 <= row[f"roc/{key}_after"] <= 1.0
    assert any("actor/loss" in row for row in rows)
    assert calls.read_text().count("called") == 2 * 2 * 16  # every trajectory, on both ranks, both steps


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["adv.resample_on_correct=true", "data.responses_per_prompt=4"], "needs rollout.oversample > data.responses_per_prompt"),
        (["rollout.oversample=8"], "rollout.oversample is GRPO-RoC's"),
        (["adv.resample_on_correct=true", "rollout.oversample=8", "data.responses_per_prompt=2", "adv.roc_min_each=2"],
         "adv.roc_min_each=2 must be between 0 and data.responses_per_prompt / 2"),
    ],
    ids=["no-oversample", "oversample-without-roc", "min-each-too-large"],
)
def test_grpo_roc_config_errors(tiny_model_dir, rl_data, tmp_path, overrides, message):
    """Raised before the process group or any model (in this process; the command line turns a
    ConfigError into one line: test_broken_env_file_fails_at_start)."""
    from rl2 import PPOTrainer
    from rl2.config import ConfigError, load_config

    with pytest.raises(ConfigError) as error:
        PPOTrainer(load_config(_ppo_args(tiny_model_dir, rl_data, str(tmp_path / "run"), *overrides)[2:]))
    assert message in str(error.value)
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def function_calling_demo(tmp_path_factory) -> str:
    """The function-calling demo's pipeline, 80 warm-up steps and 2 GRPO steps on 1 rank: its folder."""
    out = tmp_path_factory.mktemp("tools_demo")
    env = {**os.environ, "OUT": str(out), "TASK": "tools", "NPROC": "1", "SFT_STEPS": "80", "PPO_STEPS": "2",
           "PYTHONPATH": REPO}
    result = run_demo(["trainer.test_freq=null"], env)
    assert result.returncode == 0, result.stderr[-5000:]
    return str(out)


@pytest.mark.xdist_group("function_calling_demo")  # one worker builds the demo once for the tests that share it
def test_function_calling_demo_calls_natively(function_calling_demo):
    """The function-calling demo's pipeline: a warm-up on rows with tool_calls, then GRPO whose turns are parsed
    into native calls of the stateful environment's lookup(), answered as tool messages (learning is measured
    by bench/demo_seeds.py --tasks tools, recorded in bench/RESULTS.md)."""
    rows = read_metrics(os.path.join(function_calling_demo, "ppo", "metrics.jsonl"))
    assert sum(row.get("tools/lookup/calls", 0) for row in rows) > 0 and all(row["env_errors"] == 0 for row in rows)
    assert_metrics_documented(rows)  # tools/*
    dump = [json.loads(line) for line in open(os.path.join(function_calling_demo, "ppo", "trajectories", "step_2.jsonl"))]
    called = [t for t in dump if (t["messages"][1].get("tool_calls") or [{}])[0].get("function") == {
        "name": "lookup", "arguments": {}}]
    assert called, "no trajectory called the tool natively"
    for t in called:
        call, answer = t["messages"][1]["tool_calls"][0], t["messages"][2]
        assert call["id"] == "call_0" and answer["role"] == "tool" and answer["tool_call_id"] == "call_0"
        assert answer["name"] == "lookup" and answer["content"].startswith("code ")


FOLLOW_UP_ENV = """def interact(messages):
    if sum(m["role"] == "user" for m in messages) == 1:
        return [{"role": "user", "content": "Again?"}]
    return []
"""

# One trainer scores the same two-turn conversations as whole trajectories and per turn (a scripted model's
# turns, tokenised canonically as a model that writes the template's tokens would): old log-probs, the
# reference's, the critic's values, GAE's advantages and the actor's loss.
PER_TURN_CHECK = """
import sys, torch
from rl2 import PPOTrainer, load_config
from rl2.algorithms.losses import with_loss_weights
from rl2.algorithms.sequences import per_turn_sequences
from rl2.engines import SamplingParams
from rl2.rollout.multi_turn import rollout
from rl2.trainer.ppo_stages import actor_loss, add_advantages, compute_logps, sequences_of
from scripted_engine import ScriptedEngine

trainer = PPOTrainer(load_config(sys.argv[1:]))
tokenizer, env = trainer.rollout.tokenizer, trainer.rollout.env
replies = ["The answer is 7", "Then 8"]
results = {}
for per_turn in (False, True):
    engine = ScriptedEngine(tokenizer, lambda text: replies[text.count("<|im_start|>user") - 1])
    prompts = [trainer.train_data[i] for i in range(2)]
    trajectories = rollout(engine, env, tokenizer, prompts, 4, SamplingParams(), max_turns=2, per_turn=per_turn)
    for i, trajectory in enumerate(trajectories):
        trajectory.reward = float(i % 3 == 0)
    assert all(t.turns == 2 for t in trajectories) and (trajectories[0].turn_starts is not None) == per_turn
    sequences = sequences_of(trajectories, trainer.plan)
    metrics = compute_logps(sequences, trainer.plan, trainer.models, trainer.step)
    metrics.update(add_advantages(sequences, trajectories, trainer.plan, trainer.step))
    trained = per_turn_sequences(with_loss_weights(sequences))
    loss = trainer.actor.accumulate_gradients(trained, lambda o, b: actor_loss(trainer.plan, o, b))["loss"]
    grads = [p.grad.to_local().clone() for p in trainer.actor.model.parameters()]
    trainer.actor.optimizer.zero_grad(set_to_none=True)
    at_actions = {key: [s[key][s["loss_mask"].bool()] for s in sequences]
                  for key in ("old_logps", "ref_logps", "old_values", "advantages")}
    results[per_turn] = (len(trained), loss, metrics, at_actions, grads)
(n_whole, loss_whole, m_whole, whole, g_whole), (n_turns, loss_turns, m_turns, turns, g_turns) = results[False], results[True]
assert (n_whole, n_turns) == (8, 16), (n_whole, n_turns)
for key in whole:
    for a, b in zip(whole[key], turns[key], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=key)
for a, b in zip(g_whole, g_turns, strict=True):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
assert abs(m_whole["kl"] - m_turns["kl"]) < 1e-6 and abs(loss_whole - loss_turns) < 1e-5, (m_whole, m_turns, loss_whole, loss_turns)
print("PER TURN OK", loss_whole, loss_turns)
"""


def test_per_turn_trains_what_whole_trains_on_a_history_stable_template(tiny_model_dir, rl_data, tmp_path):
    """rollout.trajectory_format=per_turn on a template that never rewrites earlier turns (ChatML), with the
    model's tokens canonical: each turn's sequence is a prefix of the whole trajectory, so every generated
    token is trained once on the same context, and the scores (GAE's critic, a KL reference), the loss and
    its gradients equal the whole format's, from twice as many, shorter sequences."""
    env_file = tmp_path / "follow_up.py"
    env_file.write_text(FOLLOW_UP_ENV + "\n\ndef reward_fn(messages, answer):\n    return 0.0\n")
    args = _ppo_args(tiny_model_dir, rl_data, str(tmp_path / "run"), f"rollout.env_path={env_file}",
                     "rollout.max_turns=2", "rollout.env_workers=0", "adv.estimator=gae", "critic.dtype=float32",
                     "kl.coef=0.01")[2:]
    result = run_python(["-c", PER_TURN_CHECK, *args], env={"PYTHONPATH": f"{REPO}:{REPO}/tests"})
    assert "PER TURN OK" in result.stdout


@pytest.mark.xdist_group("function_calling_demo")
def test_an_openai_sdk_agent_trains_on_two_ranks(function_calling_demo, tmp_path):
    """The function-calling demo with its conversation held by an agent written with the OpenAI SDK
    (envs/demo_tools_agent.py) on 2 ranks, each serving its own endpoint, from the same warm-up: its requests
    are the trajectories, one exact sequence each (nothing re-encoded), and rl2 trains on them; with partial
    rollout, the agents still at work when a step has its groups go on in the next one, on their rank."""
    env = {**os.environ, "OUT": str(tmp_path), "TASK": "tools", "NPROC": "2", "PPO_STEPS": "2", "PYTHONPATH": REPO,
           "SFT_CKPT": os.path.join(function_calling_demo, "sft", "step80")}
    result = run_demo(["trainer.test_freq=null", "rollout.agent_path=envs/demo_tools_agent.py",
                       "rollout.partial_rollout=true"], env)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = read_metrics(str(tmp_path / "ppo" / "metrics.jsonl"))
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[0]["partial/carried_groups"] > 0 and rows[1]["partial/resumed_ratio"] > 0
    for row in rows:
        assert row["env_errors"] == 0 and row["trajectories"] == 128 and "actor/loss" in row
        assert 1 < row["agent/requests"] <= 2 and row["agent/sequences"] == 1 and row["agent/drift_requests"] == 0
        assert row["agent/reused_tokens"] > 0  # the second requests continued the first ones' sampled tokens
    dump = [json.loads(line) for line in open(tmp_path / "ppo" / "trajectories" / "step_2.jsonl")]
    called = [t for t in dump if t["messages"][1].get("tool_calls")]
    assert called and all(t["messages"][2]["role"] == "tool" and t["messages"][2]["content"].startswith("code ")
                          for t in called)
