"""PPO / GRPO / Dr. GRPO: `torchrun --nproc_per_node=N -m rl2.trainer.ppo key=value ...`.

One step: rollout (each rank its share of prompts) → reward (env file) → old / reference
log-probs and values on packed micro-batches → advantages → `actor.update_per_rollout`
minibatch updates → weight sync to the engine.
"""

import dataclasses
import json
import logging
import os
import sys

import torch
from tqdm import tqdm

from rl2.workers.policy import Policy
from rl2.workers.critic import Critic
from rl2.algorithms.advantages import gae, group_advantages, uniform_groups
from rl2.algorithms.losses import kl_penalty, loss_weights, masked_mean, policy_loss, value_loss
from rl2.algorithms.resample_on_correct import resample_on_correct
from rl2.config import Config, ConfigError, load_config
from rl2.data.conversations import RLDataset
from rl2.distributed.process_group import (
    all_gather_objects,
    broadcast_from_rank0,
    exit_process,
    is_rank0,
    rank,
    rank_slice,
)
from rl2.engines import SamplingParams, build_engine_from_config, check_sglang
from rl2.rollout.env import Env
from rl2.metrics import PhaseTimer, curve_summary, read_metrics
from rl2.tools.roc_penalty import roc_error_rates, roc_penalty
from rl2.rollout.trajectory import Trajectory
from rl2.rollout.multi_turn import assign_rewards, rollout
from rl2.data.sampler import BatchSampler
from rl2.trainer.base import Trainer, require, user_errors_reported
from rl2.rollout.weight_sync import iter_full_weights

# Not __name__: under `python -m rl2.trainer.ppo` that is "__main__", outside the rl2 logger.
logger = logging.getLogger("rl2.trainer.ppo")


class PPOTrainer(Trainer):
    """Policy-gradient RL on `{"messages", "answer"}` prompts scored by an env file's `reward_fn`."""

    def __init__(self, config: Config):
        self.eval_only = config.trainer.eval_only
        require(config, "data.test_path" if self.eval_only else "data.path", "actor.model_name", "rollout.env_path")
        _check_config(config)
        super().__init__(config)
        if config.rollout.engine == "sglang":
            check_sglang(config.rollout.tp_size)  # before any model is loaded
        # The env file first: a broken one fails before any model is loaded.
        self.env = Env(
            config.rollout.env_path,
            timeout=config.rollout.env_timeout,
            concurrency=config.rollout.env_concurrency,
            need_interact=config.rollout.max_turns > 1,
        )
        self.faults_logged: dict[str, int] = {}  # the env's fault totals already in the metrics
        self.max_length = config.data.max_length or config.actor.max_length_per_device * config.actor.sp_size
        prompts_per_rollout = config.data.prompts_per_rollout or config.data.batch_size
        if self.eval_only:  # the engine alone serves actor.model_name
            self.train_data, self.sampler, self.total_steps = None, None, 0
            self.test_data = RLDataset(config.data.test_path, self.tokenizer, self.max_length)
        else:
            self.train_data, self.test_data = self.load_datasets(RLDataset, self.max_length)
            self.sampler = BatchSampler(
                len(self.train_data), prompts_per_rollout, config.data.shuffle, config.trainer.seed
            )
            self.total_steps = config.trainer.total_steps or config.trainer.n_epochs * self.sampler.batches_per_epoch
        self.train_params = SamplingParams.from_dict(config.rollout.train_sampling_params)
        self.test_params = SamplingParams.from_dict(config.rollout.test_sampling_params)
        # The engine before the actor's optimizer: a GPU engine sizes its KV cache from free memory.
        self.engine = build_engine_from_config(config.rollout, config.actor, self.tokenizer, config.trainer.seed)
        self.actor = self.reference = self.critic = None
        if self.eval_only:
            logger.info(
                f"evaluating {config.actor.model_name} on {len(self.test_data)} prompts of {config.data.test_path}, "
                f"{config.rollout.test_responses_per_prompt} responses each, env={config.rollout.env_path}"
            )
            return
        temperature = self.train_params.temperature or 1.0
        optimizer_steps = self.total_steps * config.actor.update_per_rollout
        self.actor = Policy(config.actor, optimizer_steps, temperature)
        if config.kl.coef > 0:
            reference_config = dataclasses.replace(config.actor, offload_model=config.ref_actor.offload_model)
            self.reference = Policy(reference_config, 0, temperature, trainable=False)
        if config.adv.estimator == "gae":
            critic_config = dataclasses.replace(
                config.critic, model_name=config.critic.model_name or config.actor.model_name
            )
            self.critic = Critic(critic_config, self.total_steps * config.critic.update_per_rollout)
        self.resume()
        if self.step > 0:
            self.sync_weights()
        logger.info(
            f"PPO: {len(self.train_data)} prompts, {self.total_steps} steps of {prompts_per_rollout} prompts x "
            f"{config.data.responses_per_prompt} responses, up to {config.rollout.max_turns} turns, "
            f"estimator={config.adv.estimator}, env={config.rollout.env_path}"
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
        return state

    def load_extra_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.actor.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            self.critic.scheduler.load_state_dict(state["critic_scheduler"])

    # ---- the phases of a step --------------------------------------------------------------

    def generate(
        self,
        prompts: list[dict],
        params: SamplingParams,
        responses_per_prompt: int,
        seed: int,
        timer: PhaseTimer | None = None,
        release_after: bool = False,
    ) -> list[Trajectory]:
        """Roll out this rank's share of `prompts` (whole groups), score it, and gather every
        rank's trajectories on every rank, in prompt order. `release_after` puts the engine to
        sleep once generation is done (training follows; the next `sync_weights` wakes it)."""
        timer = timer or PhaseTimer()
        start, end = rank_slice(len(prompts))
        self.engine.wake()
        self.engine.reseed(seed * 1_000_003 + rank())
        with timer("rollout"):
            trajectories = rollout(
                self.engine,
                self.env,
                self.tokenizer,
                prompts[start:end],
                responses_per_prompt,
                params,
                self.config.rollout.max_turns,
                self.max_length,
                first_group=start,
            )
        if release_after:
            self.engine.sleep()
        with timer("reward"):
            assign_rewards(self.env, trajectories)
        return all_gather_objects(trajectories)

    def sync_weights(self) -> None:
        """Push the actor's weights into the engine, bucket by bucket, then wake it: with SGLang,
        weight memory is resumed, the weights pushed, and only then the KV cache resumed."""
        self.engine.update_weights(
            iter_full_weights(self.actor.model, self.config.actor.dtype, self.config.rollout.sync_bucket_mb)
        )
        self.engine.wake()

    def prepare(self, trajectories: list[Trajectory]) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Per-sequence tensors for the updates: old / reference log-probs, values, advantages."""
        config = self.config
        # An excluded trajectory (an env error, an aborted generation) stays in the batch, so groups
        # keep their shape, but carries no loss and does not count in its group's baseline.
        sequences = [
            {
                "input_ids": torch.tensor(t.token_ids),
                "loss_mask": torch.tensor(t.action_mask, dtype=torch.float32) * (not t.excluded),
                "engine_logps": torch.tensor(t.logprobs, dtype=torch.float32),
            }
            for t in trajectories
        ]
        metrics = {}
        masks = [seq["loss_mask"] for seq in sequences]
        all_masks = torch.cat(masks)
        if config.actor.recompute_logprobs:
            old_logps = self.actor.compute(sequences, "logps")
            mismatch = (torch.cat(old_logps) - torch.cat([s["engine_logps"] for s in sequences])).abs()
            metrics["logp_mismatch/mean"] = masked_mean(mismatch, all_masks).item()
            metrics["logp_mismatch/max"] = (mismatch * all_masks).max().item()
        else:  # the mismatch is then measured in the first minibatch's forward pass (actor_loss)
            old_logps = [seq["engine_logps"] for seq in sequences]
        ref_logps = self.reference.compute(sequences, "logps") if self.reference is not None else None
        if ref_logps is not None:
            kl = [kl_penalty(o, r, config.kl.reward_estimator) for o, r in zip(old_logps, ref_logps)]
            metrics["kl"] = masked_mean(torch.cat(kl), all_masks).item()
        values = self.critic.compute(sequences, "values") if self.critic is not None else None

        rewards = torch.tensor([0.0 if t.excluded else t.reward for t in trajectories], dtype=torch.float32)
        valid = torch.tensor([not t.excluded for t in trajectories])
        kl_in_reward = ref_logps is not None and config.kl.type == "reward"
        if config.adv.estimator == "reinforce":
            scores = rewards.clone()
            if kl_in_reward:
                scores -= config.kl.coef * torch.stack([(k * m).sum() for k, m in zip(kl, masks)])
            advantages = group_advantages(scores, config.data.responses_per_prompt, config.adv.norm_var, valid)
            per_token_advantages = [a * m for a, m in zip(advantages, masks)]
        else:
            per_token_advantages, returns = [], []
            for i, mask in enumerate(masks):
                token_rewards = -config.kl.coef * kl[i] * mask if kl_in_reward else torch.zeros_like(mask)
                last_action = int(mask.nonzero().max()) if mask.any() else len(mask) - 1
                token_rewards[last_action] += rewards[i]
                advantage, ret = gae(token_rewards, values[i], mask, config.adv.gamma, config.adv.lamda)
                per_token_advantages.append(advantage)
                returns.append(ret)
        for i, seq in enumerate(sequences):
            seq["old_logps"] = old_logps[i]
            seq["advantages"] = per_token_advantages[i]
            if ref_logps is not None:
                seq["ref_logps"] = ref_logps[i]
            if values is not None:
                seq["old_values"] = values[i]
                seq["returns"] = returns[i]
        metrics["advantage/mean"] = masked_mean(torch.cat(per_token_advantages), all_masks).item()
        return sequences, metrics

    def update(self, sequences: list[dict[str, torch.Tensor]], step: int) -> dict[str, float]:
        """`update_per_rollout` optimizer steps, each on a minibatch of whole groups; the critic
        first, the actor after its `freeze_steps`."""
        metrics: dict[str, list[float]] = {}
        models = [("critic", self.critic, self.critic_loss), ("actor", self.actor, self.actor_loss)]
        for name, model, loss_fn in models:
            if model is None or step <= model.config.freeze_steps:
                continue
            for minibatch in self._minibatches(sequences, model.config.update_per_rollout, step):
                weights = loss_weights([seq["loss_mask"] for seq in minibatch], model.config.loss_level)
                minibatch = [{**seq, "loss_weight": w} for seq, w in zip(minibatch, weights)]
                for key, value in model.train_step(minibatch, loss_fn, loss_total=1.0).items():
                    metrics.setdefault(f"{name}/{key}", []).append(value)
        averaged = {key: sum(values) / len(values) for key, values in metrics.items()}
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
        """PPO's clipped surrogate (plus the KL loss with kl.type=loss), weighted per token."""
        config, weight = self.config, batch["loss_weight"]
        loss, clipped = policy_loss(
            outputs["logps"], batch["old_logps"], batch["advantages"], config.actor.clip, config.actor.clip_high
        )
        metrics = {"clip_ratio": (clipped * weight).sum(), "entropy": (outputs["entropy"] * weight).sum()}
        if not config.actor.recompute_logprobs:
            # Before the first optimizer step this forward pass is the old policy's.
            mismatch = (outputs["logps"].detach() - batch["engine_logps"]).abs()
            metrics["logp_mismatch"] = (mismatch * weight).sum()
        if self.reference is not None and config.kl.type == "loss":
            kl = kl_penalty(outputs["logps"], batch["ref_logps"], config.kl.loss_estimator)
            loss = loss + config.kl.coef * kl
            metrics["kl_loss"] = (kl * weight).sum()
        return (loss * weight).sum(), metrics

    def critic_loss(self, outputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]):
        """Clipped value loss, weighted per token."""
        weight = batch["loss_weight"]
        loss, clipped = value_loss(outputs["values"], batch["old_values"], batch["returns"], self.config.critic.clip)
        return (loss * weight).sum(), {"clip_ratio": (clipped * weight).sum()}

    # ---- the loop ---------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One PPO step; returns its metrics."""
        config, timer = self.config, PhaseTimer()
        prompts = [self.train_data[i] for i in self.sampler.next_batch()]
        generated = config.rollout.oversample if config.adv.resample_on_correct else config.data.responses_per_prompt
        trajectories = self.generate(
            prompts,
            self.train_params,
            generated,
            config.trainer.seed + self.step,
            timer,
            release_after=True,
        )
        metrics = {**rollout_metrics(trajectories), **self.fault_metrics()}
        self.dump(trajectories, f"step_{self.step}")
        if config.adv.resample_on_correct:
            trajectories, roc_metrics = self.resample_on_correct(trajectories, generated)
            metrics.update(roc_metrics)
        if config.rollout.dynamic_filtering:
            trajectories, metrics["dynamic_filter/dropped_ratio"] = self.filter_groups(trajectories)
        if all(t.excluded for t in trajectories):
            logger.info(f"step {self.step}: no trajectories left to train on (equal rewards or env errors); no update")
            self.sync_weights()  # the engine may have dropped its weights while asleep
            return {**metrics, **{f"time/{k}": v for k, v in timer.times.items()}}
        with timer("logps"):
            sequences, prepared = self.prepare(trajectories)
        with timer("update"):
            updated = self.update(sequences, self.step)
        with timer("sync"):
            # Also while the actor is frozen: the engine may have dropped its weights while asleep.
            self.sync_weights()
        total = sum(timer.times.values())
        return {
            **metrics,
            **prepared,
            **updated,
            **{f"time/{k}": v for k, v in timer.times.items()},
            "time/step": total,
            "tokens_per_second": sum(len(t.token_ids) for t in trajectories) / total,
        }

    def resample_on_correct(self, trajectories: list[Trajectory], group_size: int) -> tuple[list[Trajectory], dict]:
        """GRPO-RoC: each group of `group_size` cut to `data.responses_per_prompt` (see
        `rl2.algorithms.resample_on_correct`); groups of equal rewards are dropped.

        Penalties are the env file's `roc_penalty(messages)` where it defines one (the default
        penalty where a call fails), else `rl2.tools.roc_penalty.roc_penalty`; rank 0's are used on every
        rank, so all ranks keep the same trajectories.
        """
        config = self.config
        conversations = [t.messages for t in trajectories]
        penalties = [roc_penalty(messages) for messages in conversations]
        if self.env.has_roc_penalty:
            for i, result in enumerate(self.env.roc_penalties(conversations)):
                if result.error is None:
                    penalties[i] = result.value
        penalties = broadcast_from_rank0(penalties)
        generator = torch.Generator().manual_seed(config.trainer.seed * 1_000_003 + self.step)
        keep = config.data.responses_per_prompt
        kept, dropped = [], 0
        for start in range(0, len(trajectories), group_size):
            group = trajectories[start : start + group_size]
            usable = [j for j, t in enumerate(group) if not t.excluded]  # env errors are not candidates
            chosen = resample_on_correct(
                [group[j].reward for j in usable],
                [penalties[start + j] for j in usable],
                keep,
                config.adv.roc_mode,
                config.adv.roc_min_each,
                generator,
            )
            if not chosen:
                dropped += 1
                continue
            chosen = [usable[j] for j in chosen]
            # Too few usable ones: excluded trajectories fill the group (they carry no loss).
            chosen += [j for j in range(len(group)) if group[j].excluded][: keep - len(chosen)]
            kept += [group[j] for j in sorted(chosen)]
        tool_before, format_before = roc_error_rates(conversations)
        tool_after, format_after = roc_error_rates([t.messages for t in kept])
        return kept, {
            "roc/tool_error_rate_before": tool_before,
            "roc/tool_error_rate_after": tool_after,
            "roc/format_error_rate_before": format_before,
            "roc/format_error_rate_after": format_after,
            "roc/kept_trajectories": float(len(kept)),
            "roc/dropped_groups": float(dropped),
        }

    def filter_groups(self, trajectories: list[Trajectory]) -> tuple[list[Trajectory], float]:
        """Drop groups without advantage signal: fewer than two trajectories that can train, or all
        their rewards equal; returns the dropped ratio."""
        size = self.config.data.responses_per_prompt
        groups = [trajectories[start : start + size] for start in range(0, len(trajectories), size)]
        def has_signal(group: list[Trajectory]) -> bool:
            rewards = [t.reward for t in group if not t.excluded]
            return len(rewards) > 1 and not uniform_groups(rewards, len(rewards))

        kept_groups = [group for group in groups if has_signal(group)]
        dropped = len(groups) - len(kept_groups)
        return [t for group in kept_groups for t in group], dropped / max(len(groups), 1)

    def evaluate(self, name: str | None = None) -> dict[str, float]:
        """Mean reward, avg@k (the mean share of correct responses, reward > 0) and pass@k (the
        share of prompts with a correct one), k = rollout.test_responses_per_prompt, on the test set."""
        k = self.config.rollout.test_responses_per_prompt
        prompts = [self.test_data[i] for i in range(len(self.test_data))]
        trajectories = self.generate(prompts, self.test_params, k, seed=self.config.trainer.seed - 1 - self.step)
        self.dump(trajectories, name or f"test_step_{self.step}")
        # Answers that could not be scored (env errors) count neither as right nor as wrong.
        correct = correct_by_prompt(trajectories, k)
        scored = ~correct.isnan()
        rewards = [t.reward for t in trajectories if t.reward is not None]
        return {
            "test/reward_mean": sum(rewards) / max(len(rewards), 1),
            f"test/avg@{k}": correct[scored].mean().item() if scored.any() else 0.0,
            f"test/pass@{k}": (correct.nan_to_num(0.0) > 0).any(dim=1)[scored.any(dim=1)].float().mean().item()
            if scored.any() else 0.0,
            "test/response_length": sum(t.response_length for t in trajectories) / len(trajectories),
            "test/env_errors": float(sum(len(t.errors) for t in trajectories)),
        }

    def evaluate_only(self) -> dict[str, float]:
        """`trainer.eval_only`: evaluate actor.model_name, write `<save_dir>/eval.json`, print it."""
        config = self.config
        results = self.evaluate("eval")
        self.close()
        if is_rank0():
            report = {
                "model": config.actor.model_name,
                "test_path": config.data.test_path,
                "prompts": len(self.test_data),
                "k": config.rollout.test_responses_per_prompt,
                **results,
            }
            os.makedirs(config.actor.save_dir, exist_ok=True)
            with open(os.path.join(config.actor.save_dir, "eval.json"), "w") as f:
                json.dump(report, f, indent=1)
            logger.info("evaluation: " + ", ".join(f"{key} {value:.4f}" for key, value in results.items()))
            print(json.dumps(report), flush=True)
        return results

    def fault_metrics(self) -> dict[str, float]:
        """`faults/<name>`: the faults the env's pools and clients recovered from since the last
        call (workers replaced, calls retried), summed over ranks; every name seen so far is logged,
        0 when nothing happened."""
        totals = self.env.fault_counts()
        new = {name: max(total - self.faults_logged.get(name, 0), 0) for name, total in totals.items()}
        self.faults_logged = totals
        summed: dict[str, float] = {}
        for rank_counts in all_gather_objects([new]):
            for name, count in rank_counts.items():
                summed[f"faults/{name}"] = summed.get(f"faults/{name}", 0.0) + count
        return summed

    def close(self) -> None:
        """End the env file's worker pools and the engine (SGLang: its scheduler processes)."""
        self.env.close()
        self.engine.shutdown()

    def dump(self, trajectories: list[Trajectory], name: str) -> None:
        if not (self.config.trainer.dump_trajectories and is_rank0()):
            return
        folder = os.path.join(self.config.actor.save_dir, "trajectories")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            for trajectory in trajectories:
                f.write(json.dumps(trajectory.to_json(), default=str) + "\n")

    def train(self) -> None:
        if self.eval_only:
            self.evaluate_only()
            return
        if self.step == 0 and self.test_data is not None and self.config.trainer.test_freq is not None:
            self.metrics.log(self.evaluate(), 0)  # the starting point of the test curve
        progress = tqdm(total=self.total_steps, initial=self.step, desc="PPO", disable=not is_rank0())
        while self.step < self.total_steps:
            self.step += 1
            metrics = self.train_step()
            if self.test_data is not None and self.is_test_step(self.step):
                metrics.update(self.evaluate())
            self.metrics.log(metrics, self.step)
            progress.update(1)
            progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
            if self.should_save(self.step):
                self.save(self.step)
        progress.close()
        self.metrics.finish()
        self.close()
        if is_rank0():
            rows = read_metrics(os.path.join(self.config.actor.save_dir, "metrics.jsonl"))
            logger.info("\n" + run_summary(rows))


def run_summary(rows: list[dict]) -> str:
    """The reward curve, test results and where the time of a step went, from metrics.jsonl rows."""
    lines = [curve_summary([row for row in rows if row["step"] > 0], "reward/mean")]
    tests = [(row["step"], row["test/reward_mean"]) for row in rows if "test/reward_mean" in row]
    if tests:
        lines.append("test reward: " + ", ".join(f"step {step}: {value:.3f}" for step, value in tests))
    phases = ["rollout", "reward", "logps", "update", "sync"]
    steps = [row for row in rows if "time/step" in row]
    means = {p: sum(row.get(f"time/{p}", 0.0) for row in steps) / max(len(steps), 1) for p in phases}
    step_time = sum(row["time/step"] for row in steps) / max(len(steps), 1)
    lines.append(
        f"mean step time {step_time:.3f}s: "
        + ", ".join(f"{p} {means[p]:.3f}s ({100 * means[p] / max(step_time, 1e-9):.0f}%)" for p in phases)
    )
    return "\n".join(lines)


def correct_by_prompt(trajectories: list[Trajectory], k: int) -> torch.Tensor:
    """[prompts, k] floats: 1.0 where a prompt's trajectory (of `k` consecutive ones) scored above 0,
    0.0 where it scored 0 or less, NaN where it could not be scored (excluded: an env error)."""
    return torch.tensor(
        [float("nan") if t.excluded else float(t.reward > 0) for t in trajectories], dtype=torch.float64
    ).view(-1, k)


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Reward, length, turn and error statistics of a rollout; rewards of scored trajectories only."""
    scored = [t.reward for t in trajectories if t.reward is not None]
    rewards = torch.tensor(scored or [0.0], dtype=torch.float64)
    lengths = torch.tensor([t.response_length for t in trajectories], dtype=torch.float64)
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "turns/mean": sum(t.turns for t in trajectories) / len(trajectories),
        "truncated_ratio": sum(t.truncated for t in trajectories) / len(trajectories),
        "env_errors": float(sum(len(t.errors) for t in trajectories)),
        "excluded": float(sum(t.excluded for t in trajectories)),
        "trajectories": float(len(trajectories)),
    }


def _check_config(config: Config) -> None:
    if config.rollout.max_turns < 1:
        raise ConfigError(f"rollout.max_turns must be >= 1, got {config.rollout.max_turns}")
    if config.data.responses_per_prompt < 1:
        raise ConfigError(f"data.responses_per_prompt must be >= 1, got {config.data.responses_per_prompt}")
    if config.actor.update_per_rollout < 1 or config.critic.update_per_rollout < 1:
        raise ConfigError("actor.update_per_rollout and critic.update_per_rollout must be >= 1")
    longest = config.actor.max_length_per_device * config.actor.sp_size
    if config.data.max_length is not None and config.data.max_length > longest:
        raise ConfigError(
            f"data.max_length={config.data.max_length} (the longest trajectory) exceeds what one micro-batch holds, "
            f"actor.max_length_per_device x actor.sp_size = {longest}; raise actor.max_length_per_device"
        )
    if config.adv.resample_on_correct:
        if config.rollout.oversample is None or config.rollout.oversample <= config.data.responses_per_prompt:
            raise ConfigError(
                f"adv.resample_on_correct=true needs rollout.oversample > data.responses_per_prompt "
                f"({config.data.responses_per_prompt}), e.g. 32 generated and 16 kept; got {config.rollout.oversample}"
            )
        if not 0 <= 2 * config.adv.roc_min_each <= config.data.responses_per_prompt:
            raise ConfigError(
                f"adv.roc_min_each={config.adv.roc_min_each} must be between 0 and data.responses_per_prompt / 2"
            )
    elif config.rollout.oversample is not None:
        raise ConfigError("rollout.oversample is GRPO-RoC's: set adv.resample_on_correct=true, or leave it unset")
    if config.trainer.eval_only and config.trainer.load_ckpt_from is not None:
        raise ConfigError(
            "trainer.eval_only evaluates actor.model_name: pass actor.model_name=<checkpoint folder> "
            "(e.g. ckpts/step100), not trainer.load_ckpt_from"
        )
    if config.rollout.test_responses_per_prompt < 1:
        raise ConfigError(f"rollout.test_responses_per_prompt must be >= 1, got {config.rollout.test_responses_per_prompt}")
    if config.adv.estimator == "reinforce" and config.data.responses_per_prompt == 1 and not config.trainer.eval_only:
        raise ConfigError(
            "adv.estimator=reinforce uses the group mean as baseline: set data.responses_per_prompt >= 2 "
            "(or use adv.estimator=gae)"
        )


def main() -> None:
    with user_errors_reported():
        PPOTrainer(load_config(sys.argv[1:])).train()
    exit_process(0)


if __name__ == "__main__":
    main()
