"""PPO / GRPO / Dr. GRPO: `torchrun --nproc_per_node=N -m rl2.trainer.ppo key=value ...`.

One step: rollout and rewards (`RolloutService`, each rank its share of prompts) → which groups train
(dynamic filtering, GRPO-RoC) → scoring: old / reference / teacher log-probs and values on packed
micro-batches → advantages → `actor.update_per_rollout` minibatch updates → weight sync to the engine.
"""

import dataclasses
import json
import logging
import os

import torch
from tqdm import tqdm

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
from rl2.algorithms.off_policy import Correction, correction_weights, mismatch_metrics, rollout_correction
from rl2.algorithms.overlong import overlong_penalty
from rl2.algorithms.sequences import RLSequence, computed_per_turn, joined_per_turn, per_turn_sequences, turn_start_mask
from rl2.config import Config, ConfigError, LoraConfig
from rl2.config_checks import check_config
from rl2.data.conversations import RLDataset
from rl2.data.rows import Columns, write_json
from rl2.data.sampler import BatchSampler
from rl2.distributed.process_group import is_rank0
from rl2.lora import AdaptersOff
from rl2.metrics import PhaseTimer, curve_summary, read_metrics
from rl2.distributed.placement import ROLLOUT, Placement, init_placement
from rl2.rollout.partial import PartialRollout, partial_extra_prompts, partial_rollout
from rl2.rollout.remote import RemoteRollout, RolloutServer
from rl2.rollout.rollout_metrics import rollout_metrics
from rl2.rollout.service import RolloutService
from rl2.rollout.trajectory import Trajectory
from rl2.tools.roc_penalty import roc_error_rates
from rl2.trainer.base import Trainer, run_main
from rl2.workers.critic import Critic
from rl2.workers.optim import resume_schedule
from rl2.workers.policy import Policy

# Not __name__: under `python -m rl2.trainer.ppo` that is "__main__", outside the rl2 logger.
logger = logging.getLogger("rl2.trainer.ppo")


class PPOTrainer(Trainer):
    """Policy-gradient RL on `{"messages", "answer"}` prompts (or raw `{"prompt", "answer"}` ones with
    `data.apply_chat_template=false`) scored by an env file's `reward_fn`."""

    name = "PPO"

    def __init__(self, config: Config, placement: Placement | None = None):
        check_config(config, "ppo")
        self.eval_only = config.trainer.eval_only
        super().__init__(config)
        if config.distill.coef > 0:
            check_teacher_tokenizer(self.tokenizer, config)  # before any model loads
        # The env file and the engine before any trained model: a broken env file fails first, and a
        # GPU engine sizes its KV cache from the memory still free.
        # With split placement (`placement`: this rank trains) the rollout ranks serve the batches.
        self.rollout = RemoteRollout(config, placement) if placement else RolloutService(config, self.tokenizer)
        prompts_per_rollout = config.data.prompts_per_rollout or config.data.batch_size
        max_length = self.rollout.max_length
        if self.eval_only:  # the engine alone serves actor.model_name
            self.train_data, self.sampler, self.total_steps = None, None, 0
            self.test_data = RLDataset(config.data.test_path, self.tokenizer, max_length,
                                       columns=Columns.for_run(config, "rl"), tools=self.rollout.tools)
        else:
            self.train_data, self.test_data = self.load_datasets(RLDataset, max_length, self.rollout.tools)
            self.sampler = BatchSampler(
                len(self.train_data), prompts_per_rollout, config.data.shuffle, config.trainer.seed,
                key="data.prompts_per_rollout" if config.data.prompts_per_rollout else "data.batch_size",
                source=f"training prompts of {config.data.path}",
            )
            self.total_steps = config.trainer.total_steps or config.trainer.n_epochs * self.sampler.batches_per_epoch
        self.partial = self.partial_rollout(prompts_per_rollout)
        self.actor = self.reference = self.critic = self.teacher = None
        if self.eval_only:
            logger.info(
                f"evaluating {config.actor.model_name} on {len(self.test_data)} prompts of {config.data.test_path}, "
                f"{config.rollout.test_responses_per_prompt} responses each, env={config.rollout.env_path}"
            )
            return
        temperature = self.rollout.train_params.temperature or 1.0
        optimizer_steps = self.total_steps * config.actor.update_per_rollout
        self.actor = Policy(config.actor, optimizer_steps, temperature)
        if config.kl.coef > 0 and config.actor.lora.rank > 0:
            self.reference = AdaptersOff(self.actor)  # the base model is the actor without its adapters
        elif config.kl.coef > 0:
            reference_config = dataclasses.replace(config.actor, offload_model=config.ref_actor.offload_model)
            self.reference = Policy(reference_config, 0, temperature, trainable=False)
        if config.distill.coef > 0:  # the reference model's machinery: frozen, sharded, offloadable
            teacher = config.teacher
            teacher_config = dataclasses.replace(
                config.actor, model_name=teacher.model_name, tokenizer_name=teacher.model_name,
                offload_model=teacher.offload_model, dtype=teacher.dtype or config.actor.dtype, lora=LoraConfig(),
            )
            self.teacher = Policy(teacher_config, 0, temperature, trainable=False)
        if config.adv.estimator == "gae":
            critic_config = dataclasses.replace(
                config.critic, model_name=config.critic.model_name or config.actor.model_name
            )
            self.critic = Critic(critic_config, self.total_steps * config.critic.update_per_rollout)
        self.resume()
        if self.step > 0:
            self.rollout.sync_weights(self.actor.model, version=self.step)
        logger.info(
            f"PPO: {len(self.train_data)} prompts, {self.total_steps} steps of {prompts_per_rollout} prompts x "
            f"{config.data.responses_per_prompt} responses, up to {config.rollout.max_turns} turns, "
            f"estimator={config.adv.estimator}, env={config.rollout.env_path}{self.sampler.left_over_note()}"
            + (f"; distilling from {config.teacher.model_name} (distill.mode={config.distill.mode}, "
               f"coef {config.distill.coef})" if self.teacher is not None else "")
        )

    # ---- checkpointing ----------------------------------------------------------------------

    def checkpointed_models(self) -> dict:
        models = {"actor": (self.actor.model, self.actor.optimizer)}
        if self.critic is not None:
            models["critic"] = (self.critic.model, self.critic.optimizer)
        return models

    def extra_state(self) -> dict:
        state = {"sampler": self.sampler.state_dict(), "scheduler": self.actor.scheduler.state_dict()}
        if self.critic is not None:
            state["critic_scheduler"] = self.critic.scheduler.state_dict()
        if self.partial is not None:
            state["partial_rollout"] = self.partial.state_dict()  # the carried-over groups, resumed exactly
        if isinstance(self.rollout, RemoteRollout):
            state["rollout_pipeline"] = self.rollout.state_dict()  # the batches in flight, waited for
        return state

    def load_extra_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.partial is not None and "partial_rollout" in state:
            self.partial.load_state_dict(state["partial_rollout"])
        if isinstance(self.rollout, RemoteRollout) and "rollout_pipeline" in state:
            self.rollout.load_state_dict(state["rollout_pipeline"])
        resume_schedule(self.actor.scheduler, state["scheduler"])
        if self.critic is not None:
            resume_schedule(self.critic.scheduler, state["critic_scheduler"])

    @property
    def correction(self) -> Correction:
        return rollout_correction(self.config)

    def next_prompts(self, count: int) -> list[dict]:
        """The next `count` prompts from the sampler (drawn in step order)."""
        return [self.train_data[i] for i in self.sampler.next_rows(count)]

    def partial_rollout(self, prompts_per_rollout: int) -> PartialRollout | None:
        """With `rollout.partial_rollout`: what carries unfinished groups from step to step."""
        if not self.config.rollout.partial_rollout or self.eval_only:
            return None
        extra = partial_extra_prompts(self.config)
        if prompts_per_rollout + extra > len(self.train_data):
            raise ConfigError(f"rollout.partial_rollout keeps {prompts_per_rollout} + {extra} groups in flight "
                              f"(rollout.partial_extra_prompts), more than the {len(self.train_data)} training prompts")
        if isinstance(self.rollout, RemoteRollout):
            return None  # the rollout ranks keep the groups in flight
        return partial_rollout(self.config, self.rollout)

    @property
    def generated_per_prompt(self) -> int:
        """Responses generated per prompt: GRPO-RoC's `rollout.oversample`, else data.responses_per_prompt."""
        config = self.config
        return config.rollout.oversample if config.adv.resample_on_correct else config.data.responses_per_prompt

    # ---- the phases of a step --------------------------------------------------------------

    def roll_out(self, timer: PhaseTimer) -> tuple[list[Trajectory], dict[str, float]]:
        """This step's trajectories, scored, on every rank: its prompts' (a batch from the sampler); with
        partial rollout the groups that finished first among those carried over and new prompts; with split
        placement the batch the rollout ranks generated for this step."""
        config, seed = self.config, self.config.trainer.seed + self.step
        if isinstance(self.rollout, RemoteRollout):  # the batch the rollout ranks generated rollout.max_staleness versions ago
            self.rollout.fill(self.step, self.next_prompts, self.generated_per_prompt, config.trainer.seed)
            batch = self.rollout.next_batch(timer)
            return batch.trajectories, self.rollout.pipeline_metrics(batch, self.step - 1)
        if self.partial is None:
            prompts = [self.train_data[i] for i in self.sampler.next_batch()]
            trajectories = self.rollout.generate(prompts, self.rollout.train_params, self.generated_per_prompt, seed, timer,
                                                 release_after=config.rollout.sleep)
            return trajectories, {}
        prompts = [self.train_data[i] for i in self.sampler.next_rows(self.partial.prompts_wanted())]
        version = self.step - 1  # the updates the policy has had
        trajectories = self.partial.generate(prompts, self.rollout.train_params, seed, version, timer,
                                             release_after=config.rollout.sleep)
        return trajectories, self.partial.metrics(trajectories, version)


    def score(self, trajectories: list[Trajectory]) -> tuple[list[RLSequence], dict[str, float]]:
        """The trajectories as sequences with the old policy's, the reference's, the teacher's and the
        critic's per-token outputs, computed on packed micro-batches; and the log-prob mismatch metrics."""
        # An excluded trajectory (an env error, an aborted generation) stays in the batch, so groups
        # keep their shape, but carries no loss and does not count in its group's baseline. With
        # overlong filtering a truncated one carries no loss either, but counts in the baseline.
        filtered = self.config.rollout.overlong_filtering
        sequences: list[RLSequence] = [
            {
                "input_ids": torch.tensor(t.token_ids),
                "loss_mask": torch.tensor(t.action_mask, dtype=torch.float32) * (not (t.excluded or filtered and t.truncated)),
                "engine_logps": torch.tensor(t.logprobs, dtype=torch.float32),
                **({"turn_starts": turn_start_mask(t.turn_starts, len(t.token_ids))} if t.turn_starts is not None else {}),
            }
            for t in trajectories
        ]
        metrics = {}
        if self.proximal_from_update:
            pass  # the update's forward pass gives them (`update`, `actor_loss`)
        elif self.config.actor.recompute_logprobs:
            old_logps = computed_per_turn(self.actor.compute, sequences, "logps")
            metrics.update(self.logp_mismatch(sequences, old_logps))
            for seq, logps in zip(sequences, old_logps):
                seq["old_logps"] = logps
        else:  # the mismatch is then measured in the first minibatch's forward pass (actor_loss)
            for seq in sequences:
                seq["old_logps"] = seq["engine_logps"]
        if self.correction.mode != "none":
            metrics.update(self.correct(sequences))
        if self.reference is not None:
            for seq, logps in zip(sequences, computed_per_turn(self.reference.compute, sequences, "logps")):
                seq["ref_logps"] = logps
        if self.teacher is not None:
            for seq, logps in zip(sequences, computed_per_turn(self.teacher.compute, sequences, "logps")):
                seq["teacher_logps"] = logps
        if self.critic is not None:
            for seq, values in zip(sequences, computed_per_turn(self.critic.compute, sequences, "values")):
                seq["old_values"] = values
        return sequences, metrics

    def logp_mismatch(self, sequences: list[RLSequence], proximal: list[torch.Tensor]) -> dict[str, float]:
        """How far the engine's sampling log-probs are from the actor's (`proximal`), over the trained tokens."""
        masks = [s["loss_mask"] for s in sequences]
        mismatch = (torch.cat(proximal) - torch.cat([s["engine_logps"] for s in sequences])).abs()
        all_masks = torch.cat(masks)
        return {
            "logp_mismatch/mean": masked_mean(mismatch, all_masks).item(),
            "logp_mismatch/max": (mismatch * all_masks).max().item(),
            **mismatch_metrics(proximal, [s["engine_logps"] for s in sequences], masks, self.correction.threshold),
        }

    def reference_kl(self, sequences: list[RLSequence], proximal: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each sequence's per-token KL from the policy (`proximal`) to the reference (kl.reward_estimator)."""
        kl = self.config.kl
        return [kl_penalty(logps, s["ref_logps"], kl.reward_estimator, kl.clamp) for s, logps in zip(sequences, proximal)]

    @property
    def proximal_from_update(self) -> bool:
        """Whether this step's old (proximal) log-probs come from the update's own forward pass: the batch
        trains in one minibatch, so that pass is the proximal policy's, and nothing reads them before."""
        config = self.config
        return (config.actor.recompute_logprobs and config.actor.proximal_from_update
                and config.actor.update_per_rollout == 1 and self.step > config.actor.freeze_steps
                and self.correction.mode == "none" and self.teacher is None
                and (self.reference is None or config.kl.type != "reward"))

    def correct(self, sequences: list[RLSequence]) -> dict[str, float]:
        """The rollout correction (`rl2.algorithms.off_policy`): each sequence's importance weights, and
        its rejected tokens taken out of its loss mask (so out of the loss and its denominator too), or with
        `actor.rejected_tokens=keep_in_denominator` given weight 0 (out of the loss, still counted)."""
        before = [seq["loss_mask"] for seq in sequences]
        drop = self.config.actor.rejected_tokens == "drop"
        after = []
        for seq in sequences:
            weights, keep = correction_weights(seq["old_logps"], seq["engine_logps"], seq["loss_mask"], self.correction)
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

    def add_advantages(self, sequences: list[RLSequence], trajectories: list[Trajectory]) -> dict[str, float]:
        """Each sequence's `advantages` (and `returns` with GAE) from the rewards and the scores (with
        distill.mode=reward the teacher's per-token rewards too); and the mean advantage, KL to the
        reference and reverse KL to the teacher."""
        config = self.config
        masks = [seq["loss_mask"] for seq in sequences]
        metrics, kl, dense = {}, None, None
        if self.reference is not None and not self.proximal_from_update:
            kl = self.reference_kl(sequences, [s["old_logps"] for s in sequences])
            metrics["kl"] = masked_mean(torch.cat(kl), torch.cat(masks)).item()
        if self.teacher is not None:
            student = torch.cat([s["old_logps"] for s in sequences])
            teacher = torch.cat([s["teacher_logps"] for s in sequences])
            metrics["distill/reverse_kl"] = masked_mean(reverse_kl(student, teacher), torch.cat(masks)).item()
            metrics["distill/teacher_logp"] = masked_mean(teacher, torch.cat(masks)).item()
            if config.distill.mode == "reward":
                dense = [distill_rewards(s["old_logps"], s["teacher_logps"], s["loss_mask"], config.distill.coef)
                         for s in sequences]
        advantages, returns = trajectory_advantages(
            rewards=torch.tensor([0.0 if t.excluded else t.reward for t in trajectories], dtype=torch.float32),
            valid=torch.tensor([not t.excluded for t in trajectories]),
            masks=masks,
            estimator=config.adv.estimator,
            group_size=config.data.responses_per_prompt,
            norm_var=config.adv.norm_var,
            global_norm=config.adv.global_norm,
            gamma=config.adv.gamma,
            lamda=config.adv.lamda,
            kl=kl if config.kl.type == "reward" else None,
            kl_coef=config.kl.coef,
            values=[seq["old_values"] for seq in sequences] if self.critic is not None else None,
            std_eps=config.adv.std_eps,
            dense_rewards=dense,
        )
        for i, seq in enumerate(sequences):
            seq["advantages"] = advantages[i]
            if config.adv.turn_discount != 1.0 and "turn_starts" in seq:
                seq["advantages"] = advantages[i] * turn_discounts(seq["turn_starts"], config.adv.turn_discount)
            if returns is not None:
                seq["returns"] = returns[i]
        metrics["advantage/mean"] = masked_mean(torch.cat([s["advantages"] for s in sequences]), torch.cat(masks)).item()
        return metrics

    def prepare(self, trajectories: list[Trajectory]) -> tuple[list[RLSequence], dict[str, float]]:
        """Scoring, then advantages: the sequences the updates train on, and their metrics."""
        sequences, metrics = self.score(trajectories)
        metrics.update(self.add_advantages(sequences, trajectories))
        return sequences, metrics

    def update(self, sequences: list[dict[str, torch.Tensor]], step: int) -> dict[str, float]:
        """`update_per_rollout` optimizer steps, each on a minibatch of whole groups; the critic
        first, the actor after its `freeze_steps`."""
        metrics: dict[str, list[float]] = {}
        models = [("critic", self.critic, self.critic_loss), ("actor", self.actor, self.actor_loss)]
        mismatch = {}
        for name, model, loss_fn in models:
            if model is None or step <= model.config.freeze_steps:
                continue
            for minibatch in self._minibatches(sequences, model.config.update_per_rollout, step):
                norm = model.config.loss_agg_norm or self.rollout.train_params.max_new_tokens
                minibatch = with_loss_weights(minibatch, loss_aggregation(model.config), norm)
                if name == "actor" and self.proximal_from_update:
                    stepped, proximal = model.train_step_keeping(per_turn_sequences(minibatch), loss_fn, "logps")
                    proximal = joined_per_turn(minibatch, proximal)
                    mismatch = self.logp_mismatch(minibatch, proximal)
                    if self.reference is not None:
                        kl = self.reference_kl(minibatch, proximal)
                        mismatch["kl"] = masked_mean(torch.cat(kl), torch.cat([s["loss_mask"] for s in minibatch])).item()
                else:
                    stepped = model.train_step(per_turn_sequences(minibatch), loss_fn)
                for key, value in stepped.items():
                    metrics.setdefault(f"{name}/{key}", []).append(value)
        averaged = {**mismatch, **{key: sum(values) / len(values) for key, values in metrics.items()}}
        if "actor/logp_mismatch" in metrics:  # only the first minibatch ran the old policy
            averaged["logp_mismatch/mean"] = metrics["actor/logp_mismatch"][0]
            del averaged["actor/logp_mismatch"]
        return averaged

    def _minibatches(self, sequences: list[dict], n: int, step: int) -> list[list[dict]]:
        """`n` minibatches of whole groups, shuffled the same way on every rank."""
        group_size = self.config.data.responses_per_prompt
        n_groups = len(sequences) // group_size
        order = torch.randperm(n_groups, generator=torch.Generator().manual_seed(self.config.trainer.seed + step))
        chunks = [chunk.tolist() for chunk in order.tensor_split(min(n, n_groups))]  # exactly that many
        return [[sequences[g * group_size + i] for g in sorted(chunk) for i in range(group_size)] for chunk in chunks]

    def actor_loss(self, outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
        """The policy loss (`actor.policy_loss`) times the rollout correction's importance weights, plus
        the KL loss with kl.type=loss and the distillation loss with distill.mode=loss, minus the entropy
        bonus, weighted per token."""
        config, actor = self.config, self.config.actor
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
        if not config.actor.recompute_logprobs:
            # Before the first optimizer step this forward pass is the old policy's.
            mismatch = (outputs["logps"].detach() - batch["engine_logps"]).abs()
            metrics["logp_mismatch"] = (mismatch * shown).sum()
        if self.reference is not None and config.kl.type == "loss":
            kl = kl_penalty(outputs["logps"], batch["ref_logps"], config.kl.loss_estimator, config.kl.clamp)
            if config.kl.k3_ratio_correction:  # TRL: the tokens were sampled by the old policy, not this one
                kl = kl * torch.exp(outputs["logps"] - batch["old_logps"])
            loss = loss + config.kl.coef * kl
            metrics["kl_loss"] = (kl * shown).sum()
        if self.teacher is not None and config.distill.mode == "loss":
            distill = distill_loss(outputs["logps"], batch["teacher_logps"], config.distill.loss_estimator)
            loss = loss + config.distill.coef * distill
            metrics["distill_loss"] = (distill * shown).sum()
        if actor.entropy_coef:
            loss = loss - actor.entropy_coef * outputs["entropy"]
        return (loss * weight).sum(), metrics

    def critic_loss(self, outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
        """Clipped value loss, weighted per token."""
        loss, clipped = value_loss(outputs["values"], batch["old_values"], batch["returns"], self.config.critic.clip)
        return (loss * batch["loss_weight"]).sum(), {"clip_ratio": (clipped * batch["metric_weight"]).sum()}

    # ---- the loop ---------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """The work of step `self.step` (rollout, scoring, update, weight sync) without what a run does around
        it (advancing the step, logging, testing, checkpoints: `step_once()`); returns its metrics."""
        config, timer = self.config, PhaseTimer()
        trajectories, partial_metrics = self.roll_out(timer)
        metrics = {**rollout_metrics(trajectories), **self.rollout.fault_metrics(), **partial_metrics}
        self.rollout.dump(trajectories, f"step_{self.step}")
        scored_by_env = config.rollout.env_path is not None or config.rollout.agent_path is not None
        if scored_by_env:
            self.rollout.require_scores(trajectories)
        if self.teacher is not None and not (config.distill.env_reward and scored_by_env):
            teacher_only_rewards(trajectories)
        if config.rollout.overlong_buffer > 0 or config.rollout.overlong_filtering:
            metrics.update(self.shape_overlong(trajectories))
        if config.adv.resample_on_correct:
            trajectories, roc_metrics = self.resample_on_correct(trajectories, self.generated_per_prompt)
            metrics.update(roc_metrics)
        if config.rollout.dynamic_filtering and self.teacher is None:  # the teacher's signal differs within a group
            trajectories, metrics["dynamic_filter/dropped_ratio"] = groups_with_signal(
                trajectories, config.data.responses_per_prompt
            )
        if all(t.excluded for t in trajectories):
            logger.info(f"step {self.step}: no trajectories left to train on (equal rewards or env errors); no update")
            self.rollout.sync_weights(self.actor.model, version=self.step)  # the engine may have dropped its weights while asleep
            return {**metrics, **{f"time/{k}": v for k, v in timer.times.items()}}
        with timer("logps"):
            sequences, prepared = self.prepare(trajectories)
        with timer("update"):
            updated = self.update(sequences, self.step)
        with timer("sync"):
            # Also while the actor is frozen: the engine may have dropped its weights while asleep.
            self.rollout.sync_weights(self.actor.model, version=self.step)
        total = sum(timer.times.values())
        return {
            **metrics,
            **prepared,
            **updated,
            **{f"time/{k}": v for k, v in timer.times.items()},
            "time/step": total,
            "tokens_per_second": sum(len(t.token_ids) for t in trajectories) / total,
        }

    def shape_overlong(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """DAPO's overlong shaping (`rl2.algorithms.overlong`): each scored trajectory's reward lowered by
        its soft overlong punishment (the generated tokens of all its turns against the training
        max_new_tokens); and how many were penalised, and cut at the length limit (with overlong
        filtering those carry no loss, see `score`)."""
        rollout = self.config.rollout
        limit = self.rollout.train_params.max_new_tokens
        scored = [t for t in trajectories if not t.excluded]
        penalties = [rollout.overlong_penalty * overlong_penalty(t.response_length, limit, rollout.overlong_buffer)
                     for t in scored]
        for t, penalty in zip(scored, penalties):
            t.reward += penalty
        metrics = {"overlong/truncated_ratio": sum(t.truncated for t in scored) / max(len(scored), 1)}
        if rollout.overlong_buffer > 0:
            metrics["overlong/penalized_ratio"] = sum(p < 0 for p in penalties) / max(len(scored), 1)
            metrics["overlong/penalty_mean"] = sum(penalties) / max(len(scored), 1)
        return metrics

    def resample_on_correct(self, trajectories: list[Trajectory], group_size: int) -> tuple[list[Trajectory], dict]:
        """GRPO-RoC: each group of `group_size` cut to `data.responses_per_prompt`
        (`rl2.algorithms.group_filters.resample_groups`), by the rollout's penalties."""
        config = self.config
        generator = torch.Generator().manual_seed(config.trainer.seed * 1_000_003 + self.step)
        kept, dropped = resample_groups(
            trajectories,
            self.rollout.roc_penalties(trajectories),
            group_size,
            config.data.responses_per_prompt,
            config.adv.roc_mode,
            config.adv.roc_min_each,
            generator,
        )
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

    def evaluate(self, name: str | None = None) -> dict[str, float]:
        """The rollout's `test/` metrics of the current policy on the test set (an evaluation-only
        run in which no test reward could be computed is an error)."""
        prompts = [self.test_data[i] for i in range(len(self.test_data))]
        return self.rollout.evaluate(prompts, self.config.trainer.seed - 1 - self.step, name or f"test_step_{self.step}",
                                     require_scores=self.eval_only)

    def evaluate_only(self) -> dict[str, float]:
        """`trainer.eval_only`: evaluate actor.model_name, write `<save_dir>/eval.json`, print it."""
        config = self.config
        results = self.evaluate("eval")
        if is_rank0():
            report = {
                "model": config.actor.model_name,
                "test_path": config.data.test_path,
                "prompts": len(self.test_data),
                "k": config.rollout.test_responses_per_prompt,
                **results,
            }
            write_json(os.path.join(config.actor.save_dir, "eval.json"), report)
            logger.info("evaluation: " + ", ".join(f"{key} {value:.4f}" for key, value in results.items()))
            print(json.dumps(report), flush=True)
        return results

    def train(self) -> None:
        """Train from the current step (0, or the resumed checkpoint's) to `trainer.total_steps`, calling
        `step_once()` for each step under a progress bar, then `close()`: the whole run, as
        `python -m rl2.trainer.ppo` does it. On an error the engine and the env's worker processes stop and
        the error is raised. With `trainer.eval_only`: one evaluation of `actor.model_name` instead
        (`<save_dir>/eval.json`)."""
        try:
            if self.eval_only:
                self.evaluate_only()
            else:
                with tqdm(total=self.total_steps, initial=self.step, desc="PPO", disable=not is_rank0()) as progress:
                    while self.step < self.total_steps:
                        metrics = self.step_once()
                        progress.update(1)
                        progress.set_postfix(
                            reward=f"{metrics['reward/mean']:.3f}" if "reward/mean" in metrics else "none")
        except BaseException:
            self.close_after_error()
            raise
        self.close()

    def step_once(self) -> dict[str, float]:
        """Train one step by hand (what `train()` does for each step): the test set's evaluation first when no
        step has run yet (logged at step 0, with `trainer.test_freq` set), then `self.step` advances, the
        step runs (its trajectories in `trajectories/step_<step>.jsonl`), the test set is evaluated on
        `trainer.test_freq`'s steps and the last, the metrics go to metrics.jsonl (and wandb, TensorBoard)
        and a checkpoint is saved on `actor.save_freq`'s steps and the last. Returns the step's metrics.
        Call `close()` when done (or use the trainer in a `with` block)."""
        if self.closed:
            raise RuntimeError("this trainer's run is closed (close() ended it): make a new trainer to train more")
        if self.eval_only:
            raise RuntimeError("trainer.eval_only=true trains no step: train() runs its evaluation")
        if self.step >= self.total_steps:
            raise RuntimeError(f"the run's {self.total_steps} steps are done (trainer.total_steps, or trainer.n_epochs "
                               f"of the data): call close() to end it")
        if self.step == 0 and self.test_data is not None and self.config.trainer.test_freq is not None:
            self.metrics.log(self.evaluate(), 0)  # the starting point of the test curve
        self.step += 1
        metrics = self.train_step()
        if self.test_data is not None and self.is_test_step(self.step):
            metrics.update(self.evaluate())
        self.metrics.log(metrics, self.step)
        if self.should_save(self.step):
            self.save(self.step)
        return metrics

    def close(self) -> None:
        """End the run (once; `train()` and a `with` block call it): the metrics' sinks closed (wandb
        finished), the report written (`report.html`), the engine and the env's worker processes stopped,
        and on rank 0 the run's summary logged (reward curve, test rewards, step times)."""
        if self.closed:
            return
        try:
            super().close()
        finally:
            self.rollout.close()
        path = os.path.join(self.config.actor.save_dir, "metrics.jsonl")
        if is_rank0() and not self.eval_only and os.path.exists(path):
            logger.info("\n" + run_summary(read_metrics(path)))

    def close_after_error(self) -> None:
        """End a run that failed: the engine and the env's worker processes stopped, nothing more written."""
        if not self.closed:
            self.closed = True
            self.rollout.close()


def teacher_only_rewards(trajectories: list[Trajectory]) -> None:
    """Distillation alone (distill.env_reward=false, or no env file): each trajectory that did not fail
    trains on reward 0; its env reward, where there is one, was only measured (`reward/mean`)."""
    for trajectory in trajectories:
        if not trajectory.errors:
            trajectory.reward = 0.0


def check_teacher_tokenizer(tokenizer, config: Config) -> None:
    """The teacher scores the student's token ids: refuse a teacher whose tokenizer (its vocabulary) is
    not the student's."""
    from transformers import AutoTokenizer

    student, teacher_name = config.actor.tokenizer_name or config.actor.model_name, config.teacher.model_name
    teacher = AutoTokenizer.from_pretrained(teacher_name)
    if len(teacher) != len(tokenizer):
        raise ConfigError(f"teacher.model_name={teacher_name} has a vocabulary of {len(teacher)} tokens, "
                          f"actor.model_name={config.actor.model_name} (tokenizer {student}) one of {len(tokenizer)}: "
                          "on-policy distillation compares log-probs of the same token ids, so the teacher must "
                          "share the student's tokenizer")
    student_vocab, teacher_vocab = tokenizer.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        token = min(set(student_vocab.items()) ^ set(teacher_vocab.items()), key=lambda item: item[1])
        raise ConfigError(f"teacher.model_name={teacher_name} and actor.model_name={config.actor.model_name} "
                          f"(tokenizer {student}) have vocabularies of {len(tokenizer)} tokens that differ (first "
                          f"at id {token[1]}): the teacher must share the student's tokenizer")


def run_summary(rows: list[dict]) -> str:
    """The reward curve, test results and where the time of a step went, from metrics.jsonl rows."""
    lines = [curve_summary([row for row in rows if row["step"] > 0], "reward/mean")]
    tests = [row for row in rows if "test/reward_errors" in row or "test/reward_mean" in row]
    if tests:
        lines.append("test reward: " + ", ".join(
            f"step {row['step']}: {row['test/reward_mean']:.3f}" if "test/reward_mean" in row
            else f"step {row['step']}: none ({row['test/reward_errors']:.0f} reward_fn errors)" for row in tests
        ))
    lines.append(env_error_summary(rows))
    lines.append(step_time_summary(rows))
    return "\n".join(lines)


def step_time_summary(rows: list[dict]) -> str:
    """Where the time of an updating step went, over the steps that updated (a step with no trajectory left
    to train on logs no `time/step`), and how many did not."""
    phases = ["rollout", "reward", "logps", "update", "sync"]
    ran = [row for row in rows if row["step"] > 0 and any(key.startswith("time/") for key in row)]
    steps = [row for row in ran if "time/step" in row]
    if not steps:
        return (f"no step updated the policy (none of the {len(ran)} steps had a trajectory left to train on: "
                "equal rewards in every group, see dynamic_filter/dropped_ratio, or env errors)")
    means = {p: sum(row.get(f"time/{p}", 0.0) for row in steps) / len(steps) for p in phases}
    step_time = sum(row["time/step"] for row in steps) / len(steps)
    return (f"mean step time {step_time:.3f}s"
            + (f" (of the {len(steps)} of {len(ran)} steps that updated)" if len(steps) < len(ran) else "")
            + ": " + ", ".join(f"{p} {means[p]:.3f}s ({100 * means[p] / max(step_time, 1e-9):.0f}%)" for p in phases))


def env_error_summary(rows: list[dict]) -> str:
    """How many env calls failed over a run (training steps and evaluations), and the faults its
    pools recovered from, from metrics.jsonl rows."""
    steps = [row for row in rows if row["step"] > 0 and "env_errors" in row]
    errors = sum(row["env_errors"] for row in steps)
    reward_errors = sum(row.get("reward_errors", 0.0) for row in steps)
    test_errors = sum(row.get("test/env_errors", 0.0) for row in rows)
    faults: dict[str, float] = {}
    for row in steps:
        for key, value in row.items():
            if key.startswith("faults/") and value:
                faults[key[len("faults/"):]] = faults.get(key[len("faults/"):], 0.0) + value
    line = (f"env errors: {errors:.0f} in {sum(row['env_errors'] > 0 for row in steps)} of {len(steps)} steps "
            f"({reward_errors:.0f} trajectories left unscored), {test_errors:.0f} in evaluations")
    recycled = faults.pop("env_worker_recycles", 0.0)  # planned (rollout.env_worker_max_calls), not a fault
    if faults:
        line += "; recovered faults: " + ", ".join(f"{name} {count:.0f}" for name, count in sorted(faults.items()))
    if recycled:
        line += f"; env workers recycled {recycled:.0f} times (rollout.env_worker_max_calls)"
    return line


def run(config: Config) -> None:
    """Train (or serve rollouts, on a split placement's rollout ranks)."""
    if config.rollout.placement != "split":
        PPOTrainer(config).train()
        return
    check_config(config, "ppo")  # before the world splits: a bad value stops every rank at once
    placement = init_placement(config.rollout.ranks)
    if placement.role == ROLLOUT:
        RolloutServer(config, placement).serve()
    else:
        PPOTrainer(config, placement).train()


def main() -> None:
    run_main(run, "ppo")


if __name__ == "__main__":
    main()
