"""The stages of a PPO step (`rl2.trainer.ppo_stages`) and its plan (`rl2.trainer.step_plan`), called directly:
no trainer, no engine; models only where a stage computes with one (a tiny Qwen2 on one process)."""

import pytest
import torch

from rl2.algorithms.off_policy import Correction
from rl2.config import load_config
from rl2.rollout.trajectory import Trajectory
from rl2.trainer.ppo_stages import (
    StepModels,
    actor_loss,
    add_advantages,
    compute_logps,
    minibatches,
    sequences_of,
    shape_rewards,
    update,
)
from rl2.trainer.step_plan import StepPlan


def plan_of(*overrides: str, max_new_tokens: int = 8) -> StepPlan:
    return StepPlan.from_config(load_config(list(overrides)), max_new_tokens)


def trajectory(reward: float | None, group: int = 0, generated: int = 2, truncated: bool = False,
               errors: list[str] | None = None) -> Trajectory:
    return Trajectory(messages=[], answer=None, group=group, token_ids=[5] + [6] * generated,
                      action_mask=[0] + [1] * generated, logprobs=[0.0] + [-0.5] * generated, reward=reward,
                      truncated=truncated, errors=list(errors or []))


@pytest.mark.parametrize("overrides,expected", [
    ([], True),
    (["actor.update_per_rollout=2"], False),  # the first minibatch's pass is not the proximal policy's for the second
    (["actor.recompute_logprobs=false"], False),
    (["actor.proximal_from_update=false"], False),
    (["actor.rollout_correction=tis"], False),  # the correction reads the old log-probs before the update
    (["kl.coef=0.1"], False),  # kl.type=reward: the reward reads them
    (["kl.coef=0.1", "kl.type=loss"], True),
    (["distill.coef=0.1", "teacher.model_name=t"], False),
    (["rollout.partial_rollout=true"], False),  # auto correction: tis
], ids=lambda value: ",".join(value) if isinstance(value, list) else str(value))
def test_the_plan_takes_the_proximal_log_probs_from_the_update_only_when_nothing_reads_them_before(overrides, expected):
    plan = plan_of(*overrides)
    assert plan.proximal_from_update is expected
    assert plan.proximal_in_update(1) is expected
    frozen = plan_of(*overrides, "actor.freeze_steps=3")
    assert not frozen.proximal_in_update(3) and frozen.proximal_in_update(4) is expected


def test_the_plan_holds_the_sections_a_run_has():
    plan = plan_of("data.responses_per_prompt=4", "adv.resample_on_correct=true", "rollout.oversample=6",
                   "rollout.env_path=envs/demo_successor.py")
    assert (plan.group_size, plan.generated_per_prompt, plan.scored_by_env) == (4, 6, True)
    assert plan.kl is None and plan.distill is None and plan.critic is None
    assert plan.correction == Correction("none", 2.0, 0.5, 5.0)
    assert plan_of("adv.estimator=gae").critic is not None and plan_of("kl.coef=0.2").kl.coef == 0.2
    distilling = plan_of("distill.coef=0.5", "teacher.model_name=t")
    assert distilling.teacher_rewards_only and not distilling.dynamic_filtering  # no env file: the teacher alone
    with pytest.raises(Exception):
        plan.group_size = 2  # frozen


def test_shape_rewards_runs_teacher_rewards_then_overlong_then_filtering():
    """Distillation without env rewards zeroes the scored rewards; DAPO's overlong buffer then lowers the long
    ones; a group left without signal is dropped; a failed trajectory is never rewarded."""
    plan = plan_of("distill.coef=0.5", "teacher.model_name=t", "distill.env_reward=false",
                   "rollout.env_path=envs/demo_successor.py", "rollout.overlong_buffer=4", "data.responses_per_prompt=2",
                   max_new_tokens=8)
    batch = [trajectory(1.0, 0, generated=8), trajectory(0.0, 0, generated=2), trajectory(None, 1, errors=["x"]),
             trajectory(1.0, 1, generated=2)]
    kept, metrics = shape_rewards(batch, plan, step=1, roc_penalties=lambda t: pytest.fail("no GRPO-RoC here"))
    assert [t.reward for t in batch] == [-1.0, 0.0, None, 0.0]  # 8 tokens at the limit: the whole penalty
    assert metrics["overlong/penalized_ratio"] == pytest.approx(1 / 3) and kept == batch  # distilling: no filtering
    filtering = plan_of("data.responses_per_prompt=2")
    batch = [trajectory(1.0, 0), trajectory(0.0, 0), trajectory(1.0, 1), trajectory(1.0, 1)]
    kept, metrics = shape_rewards(batch, filtering, step=1, roc_penalties=lambda t: [])
    assert kept == batch[:2] and metrics == {"dynamic_filter/dropped_ratio": 0.5}


def test_sequences_of_an_excluded_or_filtered_overlong_trajectory_carry_no_loss():
    batch = [trajectory(1.0), trajectory(None, errors=["x"]), trajectory(0.0, truncated=True)]
    plain = sequences_of(batch, plan_of())
    assert [s["loss_mask"].tolist() for s in plain] == [[0, 1, 1], [0, 0, 0], [0, 1, 1]]
    assert plain[0]["engine_logps"].tolist() == [0.0, -0.5, -0.5]
    filtered = sequences_of(batch, plan_of("rollout.overlong_filtering=true"))
    assert filtered[2]["loss_mask"].tolist() == [0, 0, 0]


def test_minibatches_keep_groups_whole_and_shuffle_by_seed_and_step():
    plan = plan_of("data.responses_per_prompt=2", "trainer.seed=1")
    sequences = [{"id": i} for i in range(8)]
    chunks = minibatches(sequences, 2, plan, step=3)
    assert len(chunks) == 2 and sorted(s["id"] for chunk in chunks for s in chunk) == list(range(8))
    for chunk in chunks:
        ids = [s["id"] for s in chunk]
        assert all(ids[i] // 2 == ids[i + 1] // 2 for i in range(0, len(ids), 2))  # a group's two together
    assert chunks == minibatches(sequences, 2, plan, step=3)
    assert len(minibatches(sequences, 9, plan, step=3)) == 4  # at most one minibatch a group


STAGES_WORKER = """
import json, sys, torch
from rl2.config import load_config
from rl2.distributed.process_group import init_distributed
from rl2.rollout.trajectory import Trajectory
from rl2.trainer.ppo_stages import StepModels, add_advantages, compute_logps, sequences_of, update
from rl2.trainer.step_plan import StepPlan
from rl2.workers.policy import Policy

init_distributed()
folder, proximal = sys.argv[1], sys.argv[2]
config = load_config([f"actor.model_name={folder}", "actor.dtype=float32", "actor.lr=1e-2", "data.responses_per_prompt=2",
                      "actor.gradient_checkpointing=false", f"actor.proximal_from_update={proximal}"])
plan = StepPlan.from_config(config, 8)
actor = Policy(config.actor, 4, 1.0)
passes = []
compute = actor.compute
actor.compute = lambda *args, **kwargs: passes.append(1) or compute(*args, **kwargs)
batch = [Trajectory(messages=[], answer=None, group=0, token_ids=[5, 6, 7, 8], action_mask=[0, 1, 1, 1],
                    logprobs=[0.0, -0.5, -0.5, -0.5], reward=reward) for reward in (1.0, 0.0)]
sequences = sequences_of(batch, plan)
before = {k: v.detach().clone() for k, v in actor.model.state_dict().items()}
logps = compute_logps(sequences, plan, StepModels(actor), step=1)
advantages = add_advantages(sequences, batch, plan, step=1)
updated = update(sequences, plan, StepModels(actor), step=1)
print(json.dumps({
    "separate_passes": len(passes), "old_logps": "old_logps" in sequences[0],
    "mismatch": logps.get("logp_mismatch/mean", updated.get("logp_mismatch/mean")),
    "advantages": sequences[0]["advantages"].tolist(), "advantage_mean": advantages["advantage/mean"],
    "moved": any(not torch.equal(before[k], v) for k, v in actor.model.state_dict().items()),
    "updated": sorted(updated),
}))
"""


def test_a_step_of_stages_on_a_tiny_actor(tiny_model_dir):
    """compute_logps, add_advantages and update on a real (one-process) actor: the old log-probs come from a
    separate pass of the actor or, with actor.proximal_from_update, from the update's own pass (then no separate
    pass runs), the mismatch to the engine's log-probs is measured either way and is the same, the advantages are
    the group's, and the update moves the weights."""
    import json

    from conftest import run_python

    runs = {flag: json.loads(run_python(["-c", STAGES_WORKER, tiny_model_dir, flag]).stdout.strip().splitlines()[-1])
            for flag in ("false", "true")}
    separate, in_update = runs["false"], runs["true"]
    assert separate["separate_passes"] == 1 and separate["old_logps"]
    assert in_update["separate_passes"] == 0 and not in_update["old_logps"]
    assert separate["mismatch"] == pytest.approx(in_update["mismatch"], rel=1e-5) and separate["mismatch"] > 0
    for run in runs.values():
        assert run["advantages"] == [0.0, 0.5, 0.5, 0.5] and run["advantage_mean"] == 0.0
        assert run["moved"] and "actor/loss" in run["updated"]


def test_the_policy_loss_adds_a_mixture_of_experts_load_balancing_loss_times_its_coefficient():
    """`actor.moe_aux_loss_coef`: the worker hands the model's router loss and its weight to `actor_loss`, which adds
    this row's share of it (the row's metric weight) to the loss and reports it unweighted."""
    plan = plan_of("actor.model_name=x", "rollout.env_path=x")
    tokens = 4
    batch = {"loss_weight": torch.full((tokens,), 0.25), "metric_weight": torch.full((tokens,), 0.125),
             "advantages": torch.tensor([1.0, -1.0, 0.5, 0.0]), "old_logps": torch.full((tokens,), -1.0)}
    outputs = {"logps": torch.full((tokens,), -1.0), "entropy": torch.zeros(tokens)}
    plain, _ = actor_loss(plan, outputs, batch)
    with_aux, metrics = actor_loss(plan, {**outputs, "moe_aux_loss": torch.tensor(3.0),
                                          "moe_aux_loss_coef": torch.tensor(0.2)}, batch)
    share = 3.0 * 0.5  # the row's metric weights sum to 0.5
    assert metrics["moe_aux_loss"].item() == pytest.approx(share)
    assert (with_aux - plain).item() == pytest.approx(0.2 * share)
