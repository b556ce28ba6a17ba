"""Env errors and recovered faults in a PPO run: trajectories that could not be scored are left out of
the update (not scored 0), and the faults an env file's pools recovered from reach the metrics."""

import json

import torch

from conftest import run_torchrun
from rl2.algorithms.advantages import group_advantages
from rl2.algorithms.group_filters import groups_with_signal
from rl2.metrics import read_metrics
from rl2.rollout.trajectory import Trajectory
from rl2.rollout.rollout_metrics import correct_by_prompt, rollout_metrics
from rl2.tools.roc_penalty import roc_penalty
from test_ppo import _ppo_args, rl_data  # noqa: F401  (the fixture)

FLAKY_ENV = """
from rl2.tools.faults import FaultCounter

faults = FaultCounter()


def reward_fn(messages, answer):
    faults.add("reward_calls")
    text = messages[-1]["content"]
    if len(text) % 3 == 0:
        raise RuntimeError("the grader is down")
    return float(len(text) % 2)
"""


def test_unscored_trajectories_are_left_out_and_faults_are_summed_over_ranks(tiny_model_dir, rl_data, tmp_path):
    env_file = tmp_path / "flaky_env.py"
    env_file.write_text(FLAKY_ENV)
    save_dir = tmp_path / "run"
    run_torchrun(_ppo_args(tiny_model_dir, rl_data, str(save_dir), f"rollout.env_path={env_file}",
                           "trainer.total_steps=3", "trainer.test_freq=null",
                           "rollout.dynamic_filtering=false"))  # every scored trajectory trains, filtered or not
    rows = read_metrics(str(save_dir / "metrics.jsonl"))
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        dump = [json.loads(line) for line in open(save_dir / "trajectories" / f"step_{row['step']}.jsonl")]
        failed = [t for t in dump if t["errors"]]
        assert all(t["reward"] is None and "the grader is down" in t["errors"][0] for t in failed)
        assert row["env_errors"] == row["excluded"] == len(failed)
        assert row["faults/reward_calls"] == 16  # 4 prompts x 4 responses, scored half on each rank
        scored = [t["reward"] for t in dump if t["reward"] is not None]
        assert row["reward/mean"] == sum(scored) / len(scored)
        if "actor/loss_tokens" in row:  # only the scored trajectories carry loss
            assert row["actor/loss_tokens"] == sum(t["response_length"] for t in dump if t["reward"] is not None)
    assert any(row["excluded"] > 0 for row in rows), "no reward_fn failed: the test checks nothing"


def test_group_advantages_leave_invalid_responses_out():
    rewards = torch.tensor([1.0, 0.0, 0.0, 5.0, 1.0, 1.0, 0.0, 7.0])
    valid = torch.tensor([True, True, True, False, True, False, False, False])
    advantages = group_advantages(rewards, 4, norm_var=True, valid=valid)
    expected = group_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, norm_var=True)
    torch.testing.assert_close(advantages[:3], expected)
    assert advantages[3] == 0.0  # invalid: no advantage, whatever its reward
    assert advantages[4:].tolist() == [0.0] * 4  # one valid response: no baseline, no signal
    unnormalised = group_advantages(rewards, 4, norm_var=False, valid=valid)
    torch.testing.assert_close(unnormalised[:4], torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0]))


def _trajectory(reward, errors=()):
    return Trajectory(messages=[], answer=None, group=0, token_ids=[1, 2, 3], action_mask=[0, 1, 1],
                      logprobs=[0.0] * 3, reward=reward, errors=list(errors))


def test_unscored_answers_count_neither_right_nor_wrong():
    trajectories = [_trajectory(1.0), _trajectory(None, ["reward_fn timed out"]), _trajectory(0.0), _trajectory(0.0)]
    correct = correct_by_prompt(trajectories, 2)
    assert correct[0, 0] == 1.0 and correct[0, 1].isnan() and correct[1].tolist() == [0.0, 0.0]
    metrics = rollout_metrics(trajectories)
    assert metrics["reward/mean"] == 1 / 3 and metrics["excluded"] == 1 and metrics["env_errors"] == 1


def test_dynamic_filtering_counts_only_scored_rewards():
    groups = [
        [_trajectory(1.0), _trajectory(0.0), _trajectory(None, ["down"]), _trajectory(None, ["down"])],  # signal
        [_trajectory(1.0), _trajectory(1.0), _trajectory(None, ["down"]), _trajectory(None, ["down"])],  # none
        [_trajectory(1.0), _trajectory(None, ["down"]), _trajectory(None, ["down"]), _trajectory(None, ["down"])],
    ]
    kept, dropped = groups_with_signal([t for group in groups for t in group], 4)
    assert kept == groups[0] and dropped == 2 / 3


def test_dynamic_filtering_keeps_everything_with_one_response_per_prompt():
    """No group to compare within (the baseline is the batch's): RL2 filters only groups of more than one."""
    trajectories = [_trajectory(1.0), _trajectory(1.0), _trajectory(0.0), _trajectory(None, ["down"])]
    kept, dropped = groups_with_signal(trajectories, 1)
    assert kept == trajectories and dropped == 0.0


def test_resample_on_correct_draws_from_scored_trajectories_only():
    from rl2.config import load_config
    from rl2.trainer.ppo_stages import resample_on_correct
    from rl2.trainer.step_plan import StepPlan

    config = load_config(["data.responses_per_prompt=4", "adv.resample_on_correct=true", "rollout.oversample=6",
                          "adv.roc_mode=topk", "adv.roc_min_each=1", "trainer.seed=0"])
    plan = StepPlan.from_config(config, train_max_new_tokens=8)
    failed = [_trajectory(None, ["down"]) for _ in range(3)]
    group = [_trajectory(1.0), failed[0], _trajectory(0.0), failed[1], _trajectory(1.0), failed[2]]
    kept, metrics = resample_on_correct(group, plan, 1, [roc_penalty(t.messages) for t in group])
    # 3 usable ones, all kept; one excluded trajectory fills the group to 4 (it carries no loss)
    assert len(kept) == 4 and sum(t.excluded for t in kept) == 1
    assert [t for t in kept if not t.excluded] == [group[0], group[2], group[4]]
    assert metrics["roc/dropped_groups"] == 0.0
