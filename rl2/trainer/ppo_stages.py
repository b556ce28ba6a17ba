"""The stages of a PPO step after its rollout, as plain functions of the data, the step's plan
(`rl2.trainer.step_plan.StepPlan`) and the models they need (`StepModels`):

    shape_rewards -> sequences_of -> compute_logps (and correct) -> add_advantages -> update

`PPOTrainer.train_step` calls them in this order between the rollout and the weight sync.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rl2.algorithms.advantages import trajectory_advantages, turn_discounts
from rl2.algorithms.distillation import distill_loss, distill_rewards, reverse_kl
from rl2.algorithms.group_filters import groups_with_signal, resample_groups
from rl2.algorithms.losses import (
    cispo_loss,
    gspo_loss,
    kl_penalty,
    loss_aggregation,
    masked_mean,
    policy_loss,
    value_loss,
    with_loss_weights,
)
from rl2.algorithms.off_policy import correction_weights, mismatch_metrics
from rl2.algorithms.overlong import overlong_penalty
from rl2.algorithms.sequences import RLSequence, computed_per_turn, joined_per_turn, per_turn_sequences, turn_start_mask
from rl2.config import ConfigError
from rl2.models.expert_load import load_max
from rl2.models.routing_replay import UNRECORDED
from rl2.rollout.trajectory import Trajectory
from rl2.tools.roc_penalty import roc_error_rates
from rl2.trainer.step_plan import StepPlan


@dataclass
class StepModels:
    """The models a step computes with: the actor, and the reference, the teacher and the critic where the
    plan has them (None otherwise)."""

    actor: Any  # rl2.workers.policy.Policy
    reference: Any = None  # a frozen Policy, or the actor with its LoRA adapters off
    teacher: Any = None
    critic: Any = None  # rl2.workers.critic.Critic


# ---- rewards ------------------------------------------------------------------------------------


def shape_rewards(trajectories: list[Trajectory], plan: StepPlan, step: int,
                  roc_penalties: Callable[[list[Trajectory]], list[float]]) -> tuple[list[Trajectory], dict[str, float]]:
    """The step's scored trajectories made the ones it trains on: the teacher-only rewards of pure distillation,
    DAPO's overlong shaping, GRPO-RoC's down-sampling (`roc_penalties`: the rollout's) and dynamic filtering."""
    metrics: dict[str, float] = {}
    if plan.teacher_rewards_only:
        teacher_only_rewards(trajectories)
    if plan.shapes_overlong:
        metrics.update(shape_overlong(trajectories, plan))
    if plan.adv.resample_on_correct:
        trajectories, roc_metrics = resample_on_correct(trajectories, plan, step, roc_penalties(trajectories))
        metrics.update(roc_metrics)
    if plan.dynamic_filtering:
        trajectories, metrics["dynamic_filter/dropped_ratio"] = groups_with_signal(trajectories, plan.group_size)
    return trajectories, metrics


def teacher_only_rewards(trajectories: list[Trajectory]) -> None:
    """Distillation alone (distill.env_reward=false, or no env file): each trajectory that did not fail
    trains on reward 0; its env reward, where there is one, was only measured (`reward/mean`)."""
    for trajectory in trajectories:
        if not trajectory.errors:
            trajectory.reward = 0.0


def shape_overlong(trajectories: list[Trajectory], plan: StepPlan) -> dict[str, float]:
    """DAPO's overlong shaping (`rl2.algorithms.overlong`): each scored trajectory's reward lowered by
    its soft overlong punishment (the generated tokens of all its turns against the training
    max_new_tokens); and how many were penalised, and cut at the length limit (with overlong
    filtering those carry no loss, see `sequences_of`)."""
    scored = [t for t in trajectories if not t.excluded]
    penalties = [plan.overlong_penalty * overlong_penalty(t.response_length, plan.train_max_new_tokens,
                                                          plan.overlong_buffer) for t in scored]
    for t, penalty in zip(scored, penalties):
        t.reward += penalty
    metrics = {"overlong/truncated_ratio": sum(t.truncated for t in scored) / max(len(scored), 1)}
    if plan.overlong_buffer > 0:
        metrics["overlong/penalized_ratio"] = sum(p < 0 for p in penalties) / max(len(scored), 1)
        metrics["overlong/penalty_mean"] = sum(penalties) / max(len(scored), 1)
    return metrics


def resample_on_correct(trajectories: list[Trajectory], plan: StepPlan, step: int,
                        penalties: list[float]) -> tuple[list[Trajectory], dict[str, float]]:
    """GRPO-RoC: each group of `plan.generated_per_prompt` cut to `plan.group_size`
    (`rl2.algorithms.group_filters.resample_groups`), by the rollout's `penalties`."""
    generator = torch.Generator().manual_seed(plan.seed * 1_000_003 + step)
    kept, dropped = resample_groups(trajectories, penalties, plan.generated_per_prompt, plan.group_size,
                                    plan.adv.roc_mode, plan.adv.roc_min_each, generator)
    tool_before, format_before = roc_error_rates([t.messages for t in trajectories])
    tool_after, format_after = roc_error_rates([t.messages for t in kept])
    return kept, {
        "roc/tool_error_rate_before": tool_before,
        "roc/tool_error_rate_after": tool_after,
        "roc/format_error_rate_before": format_before,
        "roc/format_error_rate_after": format_after,
        "roc/kept_trajectories": float(len(kept)),
        "roc/dropped_groups": float(dropped),
    }


# ---- log-probs ------------------------------------------------------------------------------------


def sequences_of(trajectories: list[Trajectory], plan: StepPlan) -> list[RLSequence]:
    """The trajectories as the sequences the models score and train on. An excluded trajectory (an env
    error, an aborted generation) stays in the batch, so groups keep their shape, but carries no loss and
    does not count in its group's baseline. With overlong filtering a truncated one carries no loss either,
    but counts in the baseline."""
    sequences = [
        {
            "input_ids": torch.tensor(t.token_ids),
            "loss_mask": torch.tensor(t.action_mask, dtype=torch.float32)
            * (not (t.excluded or plan.overlong_filtering and t.truncated)),
            "engine_logps": torch.tensor(t.logprobs, dtype=torch.float32),
            **({"turn_starts": turn_start_mask(t.turn_starts, len(t.token_ids))} if t.turn_starts is not None else {}),
            **image_fields(t),
            **route_fields(t, plan),
        }
        for t in trajectories
    ]
    recorded = next((seq["routes"] for seq in sequences if "routes" in seq), None)
    if recorded is not None:  # e.g. a refused generation's trajectory: routed live, as the packed rows need all or none
        for seq in sequences:
            if "routes" not in seq:
                seq["routes"] = recorded.new_full((len(seq["input_ids"]), *recorded.shape[1:]), UNRECORDED)
    return sequences


def route_fields(trajectory: Trajectory, plan: StepPlan) -> dict[str, torch.Tensor]:
    """R3 (actor.router_replay=r3): the experts the engine routed the trajectory's tokens to
    (`RLSequence.routes`), UNRECORDED for tokens after those it recorded; none otherwise."""
    if trajectory.routes is None or plan.actor.router_replay != "r3":
        return {}
    routes, length = trajectory.routes, len(trajectory.token_ids)
    if routes.shape[0] < length:
        routes = torch.cat([routes, routes.new_full((length - routes.shape[0], *routes.shape[1:]), UNRECORDED)])
    return {"routes": routes[:length]}


def image_fields(trajectory: Trajectory) -> dict[str, torch.Tensor]:
    """A vision-language trajectory's images as its sequence carries them into the packed rows
    (`RLSequence.pixel_values`, `image_grid_thw`; with several sequences also `turn_images`, which of them each
    sequence holds, which `split_turns` gives it); none for a trajectory without images."""
    if trajectory.images is None:
        return {}
    images = {"pixel_values": trajectory.images.pixel_values, "image_grid_thw": trajectory.images.image_grid_thw}
    if trajectory.turn_starts is None:
        return images
    if trajectory.turn_images is None or len(trajectory.turn_images) != len(trajectory.turn_starts):
        raise ConfigError("a trajectory of several sequences with images that does not say which images each "
                          "sequence holds (an RL2 HEAD env file's): rl2 trains those without images only; use an "
                          "env file (rollout.env_path) or an agent file (rollout.agent_path) with a vision-language "
                          "model")
    return {**images, "turn_images": torch.tensor(trajectory.turn_images)}


def compute_logps(sequences: list[RLSequence], plan: StepPlan, models: StepModels, step: int) -> dict[str, float]:
    """Each sequence's old (proximal) log-probs and the reference's, the teacher's and the critic's per-token
    outputs, computed on packed micro-batches, then the rollout correction; the log-prob mismatch metrics."""
    metrics: dict[str, float] = {}
    if (plan.actor.router_replay == "r3" and getattr(models.actor, "routing", None) is not None
            and not any("routes" in seq for seq in sequences)):
        raise ConfigError("actor.router_replay=r3: the rollout recorded no routes for this step's trajectories: the "
                          "engines record them for rollouts through an env file (an agent file's or an RL2 HEAD env "
                          "file's trajectories carry none), SGLang and vLLM only in versions that return routed "
                          "experts; use actor.router_replay=r2 or off")
    if plan.proximal_in_update(step):
        pass  # the update's forward pass gives them (`update`, `actor_loss`)
    elif plan.recompute_logprobs and plan.actor.router_replay == "r2" and getattr(models.actor, "routing", None):
        # R2: this forward's experts are the ones every update forward of these sequences uses
        logps, routes = models.actor.compute_with_routes(per_turn_sequences(sequences))
        old_logps = joined_per_turn(sequences, logps)
        for seq, seq_routes in zip(sequences, joined_per_turn(sequences, routes)):
            seq["routes"] = seq_routes
        metrics.update(logp_mismatch(sequences, old_logps, plan))
        for seq, logps in zip(sequences, old_logps):
            seq["old_logps"] = logps
    elif plan.recompute_logprobs:
        old_logps = computed_per_turn(models.actor.compute, sequences, "logps")
        metrics.update(logp_mismatch(sequences, old_logps, plan))
        for seq, logps in zip(sequences, old_logps):
            seq["old_logps"] = logps
    else:  # the mismatch is then measured in the first minibatch's forward pass (actor_loss)
        for seq in sequences:
            seq["old_logps"] = seq["engine_logps"]
    if plan.correction.mode != "none":
        metrics.update(correct(sequences, plan))
    if models.reference is not None:
        for seq, logps in zip(sequences, computed_per_turn(models.reference.compute, sequences, "logps")):
            seq["ref_logps"] = logps
    if models.teacher is not None:
        for seq, logps in zip(sequences, computed_per_turn(models.teacher.compute, sequences, "logps")):
            seq["teacher_logps"] = logps
    if models.critic is not None:
        for seq, values in zip(sequences, computed_per_turn(models.critic.compute, sequences, "values")):
            seq["old_values"] = values
    return metrics


def logp_mismatch(sequences: list[RLSequence], proximal: list[torch.Tensor], plan: StepPlan) -> dict[str, float]:
    """How far the engine's sampling log-probs are from the actor's (`proximal`), over the trained tokens."""
    masks = [s["loss_mask"] for s in sequences]
    mismatch = (torch.cat(proximal) - torch.cat([s["engine_logps"] for s in sequences])).abs()
    all_masks = torch.cat(masks)
    return {
        "logp_mismatch/mean": masked_mean(mismatch, all_masks).item(),
        "logp_mismatch/max": (mismatch * all_masks).max().item(),
        **mismatch_metrics(proximal, [s["engine_logps"] for s in sequences], masks, plan.correction.threshold),
    }


def correct(sequences: list[RLSequence], plan: StepPlan) -> dict[str, float]:
    """The rollout correction (`rl2.algorithms.off_policy`): each sequence's importance weights, and
    its rejected tokens taken out of its loss mask (so out of the loss and its denominator too), or with
    `actor.rejected_tokens=keep_in_denominator` given weight 0 (out of the loss, still counted)."""
    before = [seq["loss_mask"] for seq in sequences]
    drop = plan.actor.rejected_tokens == "drop"
    after = []
    for seq in sequences:
        weights, keep = correction_weights(seq["old_logps"], seq["engine_logps"], seq["loss_mask"], plan.correction)
        after.append(seq["loss_mask"] * keep)
        seq["is_weights"] = weights.float() if drop else weights.float() * keep
        if drop:
            seq["loss_mask"] = after[-1]
    tokens = sum(mask.sum() for mask in before)
    kept = torch.cat(after).bool()
    trained = [bool(mask.any()) for mask in before]
    return {
        "offpolicy/rejected_token_ratio": float(1 - sum(mask.sum() for mask in after) / tokens) if tokens else 0.0,
        "offpolicy/rejected_sequence_ratio": sum(t and not a.any() for t, a in zip(trained, after)) / max(sum(trained), 1),
        "offpolicy/is_weight_mean": float(torch.cat([s["is_weights"] for s in sequences])[kept].mean()) if kept.any() else 0.0,
    }


def reference_kl(sequences: list[RLSequence], proximal: list[torch.Tensor], plan: StepPlan) -> list[torch.Tensor]:
    """Each sequence's per-token KL from the policy (`proximal`) to the reference (kl.reward_estimator)."""
    return [kl_penalty(logps, s["ref_logps"], plan.kl.reward_estimator, plan.kl.clamp)
            for s, logps in zip(sequences, proximal)]


# ---- advantages ------------------------------------------------------------------------------------


def add_advantages(sequences: list[RLSequence], trajectories: list[Trajectory], plan: StepPlan,
                   step: int) -> dict[str, float]:
    """Each sequence's `advantages` (and `returns` with GAE) from the rewards and the scores (with
    distill.mode=reward the teacher's per-token rewards too); and the mean advantage, KL to the
    reference and reverse KL to the teacher."""
    adv = plan.adv
    masks = [seq["loss_mask"] for seq in sequences]
    metrics, kl, dense = {}, None, None
    if plan.kl is not None and not plan.proximal_in_update(step):
        kl = reference_kl(sequences, [s["old_logps"] for s in sequences], plan)
        metrics["kl"] = masked_mean(torch.cat(kl), torch.cat(masks)).item()
    if plan.distill is not None:
        student = torch.cat([s["old_logps"] for s in sequences])
        teacher = torch.cat([s["teacher_logps"] for s in sequences])
        metrics["distill/reverse_kl"] = masked_mean(reverse_kl(student, teacher), torch.cat(masks)).item()
        metrics["distill/teacher_logp"] = masked_mean(teacher, torch.cat(masks)).item()
        if plan.distill.mode == "reward":
            dense = [distill_rewards(s["old_logps"], s["teacher_logps"], s["loss_mask"], plan.distill.coef)
                     for s in sequences]
    advantages, returns = trajectory_advantages(
        rewards=torch.tensor([0.0 if t.excluded else t.reward for t in trajectories], dtype=torch.float32),
        valid=torch.tensor([not t.excluded for t in trajectories]),
        masks=masks,
        estimator=adv.estimator,
        group_size=plan.group_size,
        norm_var=adv.norm_var,
        global_norm=adv.global_norm,
        gamma=adv.gamma,
        lamda=adv.lamda,
        kl=kl if plan.kl is not None and plan.kl.type == "reward" else None,
        kl_coef=plan.kl.coef if plan.kl is not None else 0.0,
        values=[seq["old_values"] for seq in sequences] if plan.critic is not None else None,
        std_eps=adv.std_eps,
        dense_rewards=dense,
    )
    for i, seq in enumerate(sequences):
        seq["advantages"] = advantages[i]
        if adv.turn_discount != 1.0 and "turn_starts" in seq:
            seq["advantages"] = advantages[i] * turn_discounts(seq["turn_starts"], adv.turn_discount)
        if returns is not None:
            seq["returns"] = returns[i]
    metrics["advantage/mean"] = masked_mean(torch.cat([s["advantages"] for s in sequences]), torch.cat(masks)).item()
    return metrics


# ---- the update ------------------------------------------------------------------------------------


def update(sequences: list[RLSequence], plan: StepPlan, models: StepModels, step: int) -> dict[str, float]:
    """`update_per_rollout` optimizer steps of each model, each on a minibatch of whole groups; the critic
    first, the actor after its `freeze_steps`."""
    metrics: dict[str, list[float]] = {}
    mismatch: dict[str, float] = {}
    losses = [("critic", models.critic, lambda outputs, batch: critic_loss(plan, outputs, batch)),
              ("actor", models.actor, lambda outputs, batch: actor_loss(plan, outputs, batch))]
    for name, model, loss_fn in losses:
        if model is None or step <= model.config.freeze_steps:
            continue
        for minibatch in minibatches(sequences, model.config.update_per_rollout, plan, step):
            norm = model.config.loss_agg_norm or plan.train_max_new_tokens
            minibatch = with_loss_weights(minibatch, loss_aggregation(model.config), norm)
            if name == "actor" and plan.proximal_in_update(step):
                stepped, proximal = model.train_step_keeping(per_turn_sequences(minibatch), loss_fn, "logps")
                proximal = joined_per_turn(minibatch, proximal)
                mismatch = logp_mismatch(minibatch, proximal, plan)
                if plan.kl is not None:
                    kl = reference_kl(minibatch, proximal, plan)
                    mismatch["kl"] = masked_mean(torch.cat(kl), torch.cat([s["loss_mask"] for s in minibatch])).item()
            else:
                stepped = model.train_step(per_turn_sequences(minibatch), loss_fn)
            for key, value in stepped.items():
                metrics.setdefault(f"{name}/{key}", []).append(value)
    averaged = {**mismatch, **{key: sum(values) / len(values) for key, values in metrics.items()}}
    router_mismatch = getattr(models.actor, "router_mismatch", lambda: None)()
    if router_mismatch is not None:  # over the step's replayed forwards (log-probs and updates)
        averaged["router/mismatch"] = router_mismatch
    counts = getattr(models.actor, "expert_counts", lambda: None)()
    if counts is not None:  # a MoE actor's expert balance in the step's training forwards, per layer and mean
        loads = load_max(counts)
        averaged.update({f"router/load_max/layer{layer}": load for layer, load in enumerate(loads)})
        averaged["router/load_max"] = sum(loads) / len(loads)
    if "actor/logp_mismatch" in metrics:  # only the first minibatch ran the old policy
        averaged["logp_mismatch/mean"] = metrics["actor/logp_mismatch"][0]
        del averaged["actor/logp_mismatch"]
    return averaged


def minibatches(sequences: list[RLSequence], n: int, plan: StepPlan, step: int) -> list[list[RLSequence]]:
    """`n` minibatches of whole groups, shuffled the same way on every rank."""
    group_size = plan.group_size
    n_groups = len(sequences) // group_size
    order = torch.randperm(n_groups, generator=torch.Generator().manual_seed(plan.seed + step))
    chunks = [chunk.tolist() for chunk in order.tensor_split(min(n, n_groups))]  # exactly that many
    return [[sequences[g * group_size + i] for g in sorted(chunk) for i in range(group_size)] for chunk in chunks]


def actor_loss(plan: StepPlan, outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
    """The policy loss (`actor.policy_loss`) times the rollout correction's importance weights, plus
    the KL loss with kl.type=loss and the distillation loss with distill.mode=loss, minus the entropy
    bonus, weighted per token."""
    actor, kl, distill = plan.actor, plan.kl, plan.distill
    weight, shown = batch["loss_weight"], batch["metric_weight"]  # the loss's weights; its metrics'
    if "old_logps" not in batch:  # proximal_from_update: this forward pass is the proximal policy's
        batch = {**batch, "old_logps": outputs["logps"].detach()}
    if actor.policy_loss == "gspo":
        loss, clipped = gspo_loss(outputs["logps"], batch["old_logps"], batch["advantages"], batch["loss_mask"],
                                  batch["cu_seqlens"], actor.gspo_clip, actor.gspo_clip_high)
    elif actor.policy_loss == "cispo":
        clip_high = actor.clip if actor.clip_high is None else actor.clip_high
        loss, clipped = cispo_loss(outputs["logps"], batch["old_logps"], batch["advantages"], clip_high)
    else:
        loss, clipped = policy_loss(outputs["logps"], batch["old_logps"], batch["advantages"], actor.clip,
                                    actor.clip_high, actor.clip_c)
    if "is_weights" in batch:
        loss = loss * batch["is_weights"]
    metrics = {"clip_ratio": (clipped * shown).sum(), "entropy": (outputs["entropy"] * shown).sum()}
    if not actor.recompute_logprobs:
        # Before the first optimizer step this forward pass is the old policy's.
        mismatch = (outputs["logps"].detach() - batch["engine_logps"]).abs()
        metrics["logp_mismatch"] = (mismatch * shown).sum()
    if kl is not None and kl.type == "loss":
        penalty = kl_penalty(outputs["logps"], batch["ref_logps"], kl.loss_estimator, kl.clamp)
        if kl.k3_ratio_correction:  # TRL: the tokens were sampled by the old policy, not this one
            penalty = penalty * torch.exp(outputs["logps"] - batch["old_logps"])
        loss = loss + kl.coef * penalty
        metrics["kl_loss"] = (penalty * shown).sum()
    if distill is not None and distill.mode == "loss":
        distilled = distill_loss(outputs["logps"], batch["teacher_logps"], distill.loss_estimator)
        loss = loss + distill.coef * distilled
        metrics["distill_loss"] = (distilled * shown).sum()
    if actor.entropy_coef:
        loss = loss - actor.entropy_coef * outputs["entropy"]
    loss = (loss * weight).sum()
    if "moe_aux_loss" in outputs:  # a mixture-of-experts policy's router load balancing: this row's share of it
        aux = outputs["moe_aux_loss"] * shown.sum()
        loss = loss + outputs["moe_aux_loss_coef"] * aux
        metrics["moe_aux_loss"] = aux.detach()
    return loss, metrics


def critic_loss(plan: StepPlan, outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
    """Clipped value loss, weighted per token."""
    loss, clipped = value_loss(outputs["values"], batch["old_values"], batch["returns"], plan.critic.clip)
    return (loss * batch["loss_weight"]).sum(), {"clip_ratio": (clipped * batch["metric_weight"]).sum()}
