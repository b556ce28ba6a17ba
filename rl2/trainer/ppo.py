"""PPO / GRPO / Dr. GRPO: `torchrun --nproc_per_node=N -m rl2.trainer.ppo key=value ...`.

One step (`PPOTrainer.train_step`): the rollout's batch (`rl2.rollout.interface.Rollout`), then the stages of
`rl2.trainer.ppo_stages` over the run's `StepPlan` — rewards shaped, log-probs, advantages, the update — then
the weight sync to the engine. `trainer.eval_only=true` runs `rl2.trainer.ppo_eval.PPOEvaluator` instead.
"""

import dataclasses
import logging
import os

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from rl2.config import Config, ConfigError, LoraConfig
from rl2.config_checks import check_config
from rl2.data.conversations import RLDataset
from rl2.data.sampler import BatchSampler
from rl2.distributed.process_group import is_rank0
from rl2.lora import AdaptersOff
from rl2.metrics import PhaseTimer, read_metrics, run_summary
from rl2.distributed.placement import ROLLOUT, Placement, init_placement
from rl2.rollout.interface import Rollout
from rl2.rollout.partial import partial_extra_prompts
from rl2.rollout.remote import RemoteRollout, RolloutServer, log_as_rollout_rank
from rl2.rollout.rollout_metrics import rollout_metrics
from rl2.trainer.base import Trainer, run_main
from rl2.trainer.ppo_eval import PPOEvaluator, rollout_service, trajectory_dump_dir
from rl2.trainer.ppo_stages import (
    StepModels,
    add_advantages,
    compute_logps,
    sequences_of,
    shape_rewards,
    update,
)
from rl2.trainer.step_plan import StepPlan
from rl2.vision.detect import is_vision_model
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
        if config.trainer.eval_only:
            raise ConfigError("trainer.eval_only=true is an evaluation, not a training run: "
                              "rl2.trainer.ppo_eval.PPOEvaluator(config).train() runs it (as python -m rl2.trainer.ppo does)")
        super().__init__(config)
        check_vision_run(config)  # before any model loads
        if config.distill.coef > 0:
            check_teacher_tokenizer(self.tokenizer, config)
        # The env file and the engine before any trained model: a broken env file fails first, and a
        # GPU engine sizes its KV cache from the memory still free.
        # With split placement (`placement`: this rank trains) the rollout ranks serve the batches.
        self.rollout: Rollout = (remote_rollout(config, placement) if placement
                                 else rollout_service(config, self.tokenizer))
        prompts_per_rollout = config.prompts_per_step
        max_length = self.rollout.max_length
        self.train_data, self.test_data = self.load_datasets(RLDataset, max_length, self.rollout.tools)
        self.sampler = BatchSampler(
            len(self.train_data), prompts_per_rollout, config.data.shuffle, config.trainer.seed,
            key="data.prompts_per_rollout" if config.data.prompts_per_rollout else "data.batch_size",
            source=f"training prompts of {config.data.path}",
        )
        self.total_steps = config.trainer.total_steps or config.trainer.n_epochs * self.sampler.batches_per_epoch
        if config.rollout.partial_rollout:
            self.check_partial_rollout(prompts_per_rollout)
        self.plan = StepPlan.from_config(config, self.rollout.train_params.max_new_tokens)
        self.reference = self.critic = self.teacher = None
        temperature = self.rollout.train_params.temperature or 1.0
        optimizer_steps = self.total_steps * config.actor.update_per_rollout
        self.actor = Policy(config.actor, optimizer_steps, temperature)
        if self.plan.kl is not None and config.actor.lora.rank > 0:
            self.reference = AdaptersOff(self.actor)  # the base model is the actor without its adapters
        elif self.plan.kl is not None:
            reference_config = dataclasses.replace(config.actor, offload_model=config.ref_actor.offload_model)
            self.reference = Policy(reference_config, 0, temperature, trainable=False)
        if self.plan.distill is not None:  # the reference model's machinery: frozen, sharded, offloadable
            teacher = config.teacher
            teacher_config = dataclasses.replace(
                config.actor, model_name=teacher.model_name, tokenizer_name=teacher.model_name,
                offload_model=teacher.offload_model, dtype=config.teacher_dtype, lora=LoraConfig(),
            )
            self.teacher = Policy(teacher_config, 0, temperature, trainable=False)
        if self.plan.critic is not None:
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

    @property
    def models(self) -> StepModels:
        """The models a step computes with."""
        return StepModels(self.actor, self.reference, self.teacher, self.critic)

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
        state.update(self.rollout.state_dict())  # the groups or batches in flight, resumed exactly
        return state

    def load_extra_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.rollout.load_state_dict(state)
        resume_schedule(self.actor.scheduler, state["scheduler"])
        if self.critic is not None:
            resume_schedule(self.critic.scheduler, state["critic_scheduler"])

    def next_prompts(self, count: int) -> list[dict]:
        """The next `count` prompts from the sampler (drawn in step order)."""
        return [self.train_data[i] for i in self.sampler.next_rows(count)]

    def check_partial_rollout(self, prompts_per_rollout: int) -> None:
        """With `rollout.partial_rollout`: the groups kept in flight fit in the training prompts."""
        extra = partial_extra_prompts(self.config.rollout, prompts_per_rollout)
        if prompts_per_rollout + extra > len(self.train_data):
            raise ConfigError(f"rollout.partial_rollout keeps {prompts_per_rollout} + {extra} groups in flight "
                              f"(rollout.partial_extra_prompts), more than the {len(self.train_data)} training prompts")

    # ---- the step ---------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """The work of step `self.step` (rollout, scoring, update, weight sync) without what a run does around
        it (advancing the step, logging, testing, checkpoints: `step_once()`); returns its metrics."""
        plan, models, step, timer = self.plan, self.models, self.step, PhaseTimer()
        trajectories, rollout_own = self.rollout.next_batch(step, self.next_prompts, plan.generated_per_prompt, timer)
        metrics = {**rollout_metrics(trajectories), **self.rollout.fault_metrics(), **rollout_own}
        self.rollout.dump(trajectories, f"step_{step}")
        if plan.scored_by_env:
            self.rollout.check_rewards(trajectories)
        trajectories, shaped = shape_rewards(trajectories, plan, step, self.rollout.roc_penalties)
        metrics.update(shaped)
        if all(t.excluded for t in trajectories):
            logger.info(f"step {step}: no trajectories left to train on (equal rewards or env errors); no update")
            self.rollout.sync_weights(self.actor.model, version=step)  # the engine may have dropped its weights while asleep
            return {**metrics, **{f"time/{k}": v for k, v in timer.times.items()}}
        with timer("logps"):
            sequences = sequences_of(trajectories, plan)
            metrics.update(compute_logps(sequences, plan, models, step))
            metrics.update(add_advantages(sequences, trajectories, plan, step))
        with timer("update"):
            metrics.update(update(sequences, plan, models, step))
        with timer("sync"):  # also while the actor is frozen: the engine may have dropped its weights while asleep
            self.rollout.sync_weights(self.actor.model, version=step)
        total = sum(timer.times.values())
        return {
            **metrics,
            **{f"time/{k}": v for k, v in timer.times.items()},
            "time/step": total,
            "tokens_per_second": sum(len(t.token_ids) for t in trajectories) / total,
        }

    def evaluate(self) -> dict[str, float]:
        """The rollout's `test/` metrics of the current policy on the test set."""
        prompts = [self.test_data[i] for i in range(len(self.test_data))]
        return self.rollout.evaluate(prompts, self.config.trainer.seed - 1 - self.step, f"test_step_{self.step}")

    def train(self) -> None:
        """Train from the current step (0, or the resumed checkpoint's) to `trainer.total_steps`, calling
        `step_once()` for each step under a progress bar, then `close()`: the whole run, as
        `python -m rl2.trainer.ppo` does it. On an error the engine and the env's worker processes stop and
        the error is raised."""
        try:
            with tqdm(total=self.total_steps, initial=self.step, desc="PPO", disable=not is_rank0()) as progress:
                while self.step < self.total_steps:
                    metrics = self.step_once()
                    progress.update(1)
                    progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}" if "reward/mean" in metrics else "none")
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
        super().close()
        path = os.path.join(self.config.actor.save_dir, "metrics.jsonl")
        if is_rank0() and os.path.exists(path):
            logger.info("\n" + run_summary(read_metrics(path)))

    def release(self) -> None:
        """The engine and the env's worker processes stopped."""
        self.rollout.close()


def check_vision_run(config: Config) -> None:
    """A vision-language actor trains with a reference of its own kind (a copy of it), and a teacher and a critic
    that read images too. Refuse the rest before any model loads."""
    if not is_vision_model(config.actor.model_name):
        if config.distill.coef > 0 and is_vision_model(config.teacher.model_name):
            raise ConfigError(f"teacher.model_name={config.teacher.model_name} is a vision-language model and "
                              f"actor.model_name={config.actor.model_name} a text-only one: distil from a text model")
        return
    actor = config.actor.model_name
    critic = config.critic.model_name or actor
    if config.adv.estimator == "gae" and not is_vision_model(critic):
        raise ConfigError(f"critic.model_name={critic} is a text-only model and actor.model_name={actor} a "
                          f"vision-language one: the critic must read the trajectories' images too (use a "
                          f"vision-language critic, e.g. the actor's model: leave critic.model_name unset)")
    if config.adv.estimator == "gae" and config.critic.sp_size > 1:
        raise ConfigError(f"critic.model_name={critic} is a vision-language model: as a critic it trains with "
                          f"critic.sp_size=1 only (ring attention is tested for its policy); set critic.sp_size=1")
    if config.distill.coef > 0 and not is_vision_model(config.teacher.model_name):
        raise ConfigError(f"teacher.model_name={config.teacher.model_name} is a text-only model and "
                          f"actor.model_name={actor} a vision-language one: the teacher must read the trajectories' "
                          f"images too (use a vision-language teacher of the same tokenizer)")


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


def remote_rollout(config: Config, placement: Placement) -> RemoteRollout:
    """The trainers' side of a split placement's rollout, given the sections and values of `config` it reads."""
    return RemoteRollout(config.rollout, config.data, config.actor, placement, seed=config.trainer.seed,
                         engine_dtype=config.engine_dtype, prompts_per_step=config.prompts_per_step,
                         dump_dir=trajectory_dump_dir(config))


def serve_rollouts(config: Config, placement: Placement) -> None:
    """A split placement's rollout rank: its `RolloutServer` serves the trainers until they stop it."""
    log_as_rollout_rank(placement)  # before the service is built: its warnings name the rank
    torch.manual_seed(config.trainer.seed)
    tokenizer = AutoTokenizer.from_pretrained(config.actor.tokenizer_name or config.actor.model_name)
    RolloutServer(rollout_service(config, tokenizer), placement).serve()


def run(config: Config) -> None:
    """Train (or serve rollouts, on a split placement's rollout ranks)."""
    if config.trainer.eval_only:
        PPOEvaluator(config).train()
        return
    if config.rollout.placement != "split":
        PPOTrainer(config).train()
        return
    check_config(config, "ppo")  # before the world splits: a bad value stops every rank at once
    placement = init_placement(config.rollout.ranks)
    if placement.role == ROLLOUT:
        serve_rollouts(config, placement)
    else:
        PPOTrainer(config, placement).train()


def main() -> None:
    run_main(run, "ppo")


if __name__ == "__main__":
    main()
