"""bench/vs_trl.py without TRL (a benchmark dependency): rl2's runs ask for TRL's settings in keys rl2 reads, and
the table's figures are what the script says they are."""

import os
import statistics
import sys

import pytest

from conftest import REPO
from rl2.config import load_config

sys.path.insert(0, os.path.join(REPO, "bench"))
import vs_trl  # noqa: E402


@pytest.mark.parametrize("size,filtering,device", [("demo", False, "cpu"), ("large", True, "cpu"), ("0.5b", False, "cuda")])
def test_rl2_runs_ask_for_trls_settings(size, filtering, device):
    """Every key parses as rl2's PPO trainer reads it, with the values FAIRNESS promises."""
    settings = vs_trl.SIZES[size]
    arguments = vs_trl.rl2_arguments("model", "data", "out", settings, seed=7, steps=60, filtering=filtering,
                                     device=device)
    config = load_config(arguments, command="ppo")
    assert config.data.prompts_per_rollout * config.data.responses_per_prompt == 128 == config.rollout.max_batch_size
    assert config.rollout.dynamic_filtering is filtering
    train, test = config.rollout.train_sampling_params, config.rollout.test_sampling_params
    assert train["max_new_tokens"] == test["max_new_tokens"] == settings["new_tokens"]
    assert train["temperature"] == 1.0 and test["temperature"] == 0.0
    assert config.actor.lr == settings["lr"] and config.actor.warmup_ratio == 0.1
    assert config.actor.dtype == ("bfloat16" if device == "cuda" else "float32")
    assert config.rollout.sleep is (device != "cuda")  # TRL generates with its training model: nothing offloaded
    assert (config.adv.estimator, config.adv.norm_var, config.adv.std_eps) == ("reinforce", True, 1e-4)
    assert not config.actor.gradient_checkpointing and config.trainer.seed == 7 and config.trainer.total_steps == 60


def test_the_summary_leaves_out_the_warm_up_steps_and_averages_the_curve():
    steps = 25
    run = {"step_seconds": [5.0] * vs_trl.SKIP + [0.5 + 0.01 * i for i in range(steps - vs_trl.SKIP)],
           "rewards": [i / steps for i in range(steps)], "lengths": [10.0] * vs_trl.SKIP + [6.0] * (steps - vs_trl.SKIP),
           "trained": [128.0] * vs_trl.SKIP + [64.0] * (steps - vs_trl.SKIP), "test": 0.75}
    row = vs_trl.summary(run)
    seconds = statistics.median(run["step_seconds"][vs_trl.SKIP:])
    assert row["s_step"] == pytest.approx(seconds) and seconds < 1.0
    assert row["samples_s"] == pytest.approx(64.0 / seconds)
    assert row["tokens_s"] == pytest.approx(6.0 * 128 / seconds)  # every generated answer, trained or filtered
    assert row["first"] == pytest.approx(statistics.mean(run["rewards"][:6]))
    assert row["last"] == pytest.approx(statistics.mean(run["rewards"][-6:])) and row["test"] == 0.75
    assert row["curve"] == pytest.approx([0.18, 0.58, 0.88])  # steps 0-9, 10-19, 20-24
