"""On-policy distillation: the teacher's per-token reverse KL as a reward and as a loss (fp64 equations),
through the advantage estimators, its config checks and tokenizer check, a teacher equal to the student,
1 vs 2 ranks in loss mode, and the CPU recipe. The trainer's wiring of each key: test_ppo_reference.py's
`distill-*` cases."""

import json
import os
import re
import subprocess

import pytest
import torch
from transformers import AutoTokenizer

from conftest import REPO, assert_same_gradients, run_python, run_torchrun
from rl2.algorithms.advantages import trajectory_advantages
from rl2.algorithms.distillation import distill_loss, distill_rewards, reverse_kl
from rl2.config import ConfigError, load_config
from rl2.config_checks import check_config
from rl2.metrics import read_metrics
from rl2.testing.tiny import save_tiny
from rl2.trainer.ppo import check_teacher_tokenizer
from test_ppo import _assert_same_sgd_update, rl_data  # noqa: F401  (the fixture)
from test_ppo_reference import Case, run_case

def logps(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


STUDENT = logps(0.0, -1.2, -0.3, -2.5, -0.7)  # the first token: the prompt's, mask 0
TEACHER = logps(0.0, -0.4, -1.9, -2.5, -0.1)
MASK = logps(0, 1, 1, 1, 1)


def test_reverse_kl_and_the_per_token_reward():
    """reward_t = -coef (log p_s(y_t) - log p_t(y_t)) on generated tokens, 0 elsewhere."""
    coef = 0.7
    expected = logps(0.0, -0.7 * (-1.2 + 0.4), -0.7 * (-0.3 + 1.9), 0.0, -0.7 * (-0.7 + 0.1))
    torch.testing.assert_close(reverse_kl(STUDENT, TEACHER), logps(0.0, -0.8, 1.6, 0.0, -0.6), rtol=0, atol=1e-15)
    got = distill_rewards(STUDENT, TEACHER, MASK, coef)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    assert distill_rewards(STUDENT, STUDENT, MASK, coef).abs().max() == 0  # the teacher is the student: no signal


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_loss_term_and_its_gradient(estimator):
    """Per token, with d = log p_s - log p_t: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d; the gradient goes to
    the student only: dk/dlog p_s = 1, d, 1 - exp(-d); none reaches the teacher."""
    student, teacher = STUDENT.clone().requires_grad_(), TEACHER.clone().requires_grad_()
    loss = distill_loss(student, teacher, estimator)
    d = STUDENT - TEACHER
    value = {"k1": d, "k2": d**2 / 2, "k3": torch.exp(-d) - 1 + d}[estimator]
    slope = {"k1": torch.ones_like(d), "k2": d, "k3": 1 - torch.exp(-d)}[estimator]
    torch.testing.assert_close(loss, value, rtol=0, atol=1e-15)
    coef = 0.3
    (coef * loss * MASK).sum().backward()
    torch.testing.assert_close(student.grad, coef * slope * MASK, rtol=0, atol=1e-15)
    assert teacher.grad is None


def test_per_token_rewards_through_the_estimators():
    """The dense rewards go where the KL penalty goes: summed into each score for the group baseline
    (GRPO, with its std), per token into reinforce_plus_plus's discounted returns (then whitened)."""
    masks = [logps(0, 1, 1), logps(0, 1, 0), logps(0, 1, 1), logps(0, 0, 1)]
    dense = [logps(0.0, -0.5, 0.25), logps(0.0, 0.1, 9.0), logps(0.0, -1.0, -1.0), logps(0.0, 7.0, 0.5)]
    rewards, valid = logps(1.0, 0.0, 0.0, 1.0), torch.ones(4, dtype=torch.bool)
    advantages, _ = trajectory_advantages(rewards, valid, masks, "reinforce", group_size=2, norm_var=True,
                                          dense_rewards=dense)
    scores = [1.0 - 0.5 + 0.25, 0.0 + 0.1, 0.0 - 1.0 - 1.0, 1.0 + 0.5]  # masked tokens do not count
    for group in (0, 1):
        a, b = scores[2 * group], scores[2 * group + 1]
        mean, std = (a + b) / 2, abs(a - b) / 2**0.5  # unbiased std of two
        for i, score in zip((2 * group, 2 * group + 1), (a, b)):
            torch.testing.assert_close(advantages[i], (score - mean) / (std + 1e-6) * masks[i], rtol=0, atol=1e-12)
    gamma = 0.5
    advantages, _ = trajectory_advantages(rewards, valid, masks, "reinforce_plus_plus", group_size=2, gamma=gamma,
                                          dense_rewards=dense)
    returns = [  # per action token: its reward (the env reward on the last one) + gamma x the next action token's
        [0.0, -0.5 + gamma * (0.25 + 1.0), 0.25 + 1.0],
        [0.0, 0.1 + 0.0, 0.0],
        [0.0, -1.0 + gamma * (-1.0 + 0.0), -1.0 + 0.0],
        [0.0, 0.0, 0.5 + 1.0],
    ]
    kept = torch.tensor([r for row, m in zip(returns, masks) for r, keep in zip(row, m) if keep], dtype=torch.float64)
    for i, row in enumerate(returns):
        expected = (logps(*row) - kept.mean()) / torch.sqrt(kept.var() + 1e-8) * masks[i]
        torch.testing.assert_close(advantages[i], expected, rtol=0, atol=1e-12)


def test_per_token_rewards_on_gae_are_the_kl_penalty_path():
    """On GAE's path a dense reward is the negated KL penalty of kl.type=reward, token for token."""
    masks = [logps(0, 1, 1, 0, 1), logps(0, 0, 1, 1, 1)]
    dense = [logps(0.0, 0.3, -0.2, 5.0, 0.1), logps(0.0, 2.0, -0.4, 0.6, -0.3)]
    values = [logps(0.0, 0.2, 0.1, 0.4, 0.3), logps(0.0, 0.5, -0.1, 0.2, 0.0)]
    common = dict(rewards=logps(1.0, 0.0), valid=torch.ones(2, dtype=torch.bool), masks=masks, estimator="gae",
                  group_size=1, gamma=0.9, lamda=0.8, values=values)
    with_dense, returns = trajectory_advantages(**common, dense_rewards=dense)
    with_kl, kl_returns = trajectory_advantages(**common, kl=[-d for d in dense], kl_coef=1.0)
    for got, expected in zip(with_dense + returns, with_kl + kl_returns):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    without, _ = trajectory_advantages(**common)
    assert max((a - b).abs().max().item() for a, b in zip(with_dense, without)) > 0.01


def config(*overrides: str):
    return load_config(["data.path=train.jsonl", "actor.model_name=Qwen/Qwen2.5-0.5B-Instruct", *overrides], "ppo")


@pytest.mark.parametrize("overrides, message", [
    (["rollout.env_path=envs/demo_successor.py", "distill.coef=1.0"], "pass teacher.model_name"),
    (["rollout.env_path=envs/demo_successor.py", "teacher.model_name=Qwen/Qwen2.5-7B-Instruct"],
     "distill.coef=0: the teacher would not be used"),
    (["distill.coef=-1", "rollout.env_path=envs/demo_successor.py"], "distill.coef must be >= 0"),
    (["distill.coef=1", "teacher.model_name=Qwen/Qwen2.5-7B-Instruct", "trainer.test_freq=10"],
     "trainer.test_freq evaluates the env file's reward"),
    (["distill.coef=1", "teacher.model_name=Qwen/Qwen2.5-7B-Instruct", "rollout.max_turns=2"],
     "rollout.max_turns > 1 needs an env file"),
    (["distill.coef=1", "teacher.model_name=./no/such/teacher", "rollout.env_path=envs/demo_successor.py"],
     "teacher.model_name=./no/such/teacher: no such model folder"),
    (["distill.mode=kl"], "invalid value for 'distill.mode'"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_config(config(*overrides), "ppo")


def test_distilling_needs_no_env_file():
    check_config(config("distill.coef=1", "teacher.model_name=Qwen/Qwen2.5-7B-Instruct"), "ppo")
    with pytest.raises(ConfigError, match="rollout.env_path is required"):
        check_config(config(), "ppo")
    with pytest.raises(ConfigError, match="does not read teacher.model_name"):
        load_config(["teacher.model_name=x"], "sft")


def test_a_teacher_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    """Another vocabulary size, or the same size with other tokens: a ConfigError naming both models."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    smaller = save_tiny(str(tmp_path / "smaller"), vocab_size=512)
    other = save_tiny(str(tmp_path / "other"), seed=1)
    assert len(AutoTokenizer.from_pretrained(other)) == len(tokenizer)
    for teacher, what in ((smaller, "has a vocabulary of"), (other, "that differ")):
        settings = config(f"actor.model_name={tiny_model_dir}", "distill.coef=1", f"teacher.model_name={teacher}")
        with pytest.raises(ConfigError, match=what) as error:
            check_teacher_tokenizer(tokenizer, settings)
        assert teacher in str(error.value) and tiny_model_dir in str(error.value)
    same = save_tiny(str(tmp_path / "wider"), hidden_size=128)  # another model, the same tokenizer
    check_teacher_tokenizer(tokenizer, config(f"actor.model_name={tiny_model_dir}", f"teacher.model_name={same}",
                                              "distill.coef=1"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_teacher_equal_to_the_student_gives_no_signal(tiny_model_dir, rl_data, tmp_path, dtype):
    """teacher.model_name = actor.model_name: reverse KL 0 on every token, so without an env file (no env reward:
    the batch's rewards of 1 and 0 do not train) the step's gradients vanish. With teacher.dtype=bfloat16 (the
    student in float32) the teacher's log-probs are rounded: a signal, so the key is read."""
    case = Case("", distill_coef=1.0, extra=["rollout.env_path=null", f"teacher.dtype={dtype}"])
    _, captured = run_case(case, tiny_model_dir, rl_data, tmp_path, teacher_dir=tiny_model_dir)
    metrics = captured["metrics"]
    assert metrics["distill/teacher_logp"] < -1.0  # the tiny model's log-probs, not zeros
    largest = max(g.abs().max().item() for g in captured["steps"]["actor"][0]["grads"].values())
    if dtype == "float32":
        assert abs(metrics["distill/reverse_kl"]) <= 1e-6, metrics
        assert largest < 1e-6
    else:
        assert metrics["distill/reverse_kl"] != 0 and largest > 1e-4, (metrics, largest)


def test_loss_mode_is_world_size_invariant(tiny_model_dir, peaked_model_dir, rl_data, tmp_path):
    """The same rollout with the distillation loss (and GRPO's) gives the same gradients at each optimizer
    step, the same parameters and the same distill/* metrics on 1 and 2 ranks."""
    args = ["tests/workers/ppo_update.py", tiny_model_dir, f"{rl_data}/train.jsonl", "envs/demo_successor.py"]
    teacher = f"teacher.model_name={peaked_model_dir}"
    run_python([*args, str(tmp_path / "one.pt"), "distill-loss", teacher])
    run_torchrun([*args, str(tmp_path / "two.pt"), "distill-loss", teacher])
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert len(one["actor"]["steps"]) == len(two["actor"]["steps"]) == 2
    for one_step, two_step in zip(one["actor"]["steps"], two["actor"]["steps"]):
        assert_same_gradients(two_step["grads"], one_step["grads"])
    _assert_same_sgd_update(one["actor"], two["actor"])
    assert one["metrics"]["distill/reverse_kl"] > 1.0  # the peaked teacher is far from the student
    for key in ("distill/reverse_kl", "distill/teacher_logp", "actor/distill_loss", "actor/loss"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key


def test_the_recipe_runs_and_logs_distill_metrics(tiny_model_dir, peaked_model_dir, tmp_path):
    """recipes/distill_tiny.sh, shortened (the warm-ups skipped: TEACHER / STUDENT given; 2 distillation steps;
    one rank): the teacher is evaluated, the student distils with the env reward measured but not trained on,
    and every step logs distill/* and reward/mean. Whether the student learns is recorded in
    bench/RESULTS.md, not asserted."""
    env = {**os.environ, "OUT": str(tmp_path), "NPROC": "1", "TEACHER": peaked_model_dir, "STUDENT": tiny_model_dir,
           "DISTILL_STEPS": "2", "PYTHONPATH": REPO, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(["bash", "recipes/distill_tiny.sh", "trainer.test_freq=null", "trainer.dump_trajectories=false"],
                            capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-5000:]
    assert not (tmp_path / "teacher" / "sft").exists()  # no warm-up ran
    assert "test/reward_mean" in json.load(open(tmp_path / "teacher_eval" / "eval.json"))
    rows = read_metrics(str(tmp_path / "distill" / "metrics.jsonl"))
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["distill/reverse_kl"] > 1.0 and row["distill/teacher_logp"] < 0, row  # the peaked teacher
        assert 0.0 <= row["reward/mean"] <= 1.0  # measured by envs/demo_successor.py
    assert f"distilling from {peaked_model_dir}" in result.stderr
