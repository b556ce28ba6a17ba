"""Every decision a PPO step makes, taken once from the config (`StepPlan.from_config`): the stages of
`rl2.trainer.ppo_stages` read this plan, never the whole `Config`."""

from dataclasses import dataclass

from rl2.algorithms.off_policy import Correction, rollout_correction
from rl2.config import ActorConfig, AdvConfig, Config, CriticConfig, DistillConfig, KLConfig


@dataclass(frozen=True)
class StepPlan:
    """What a step does, and with which settings. `kl`, `distill` and `critic` are None when the run has no
    reference model, no teacher and no critic."""

    seed: int  # trainer.seed: minibatch shuffles and GRPO-RoC's draws derive from it and the step
    group_size: int  # responses per prompt trained on (data.responses_per_prompt)
    generated_per_prompt: int  # responses per prompt generated: GRPO-RoC's rollout.oversample, else group_size
    train_max_new_tokens: int  # of the training sampling params: overlong shaping and the loss norm's default
    scored_by_env: bool  # an env file or an agent gives the rewards (else only the teacher does)
    teacher_rewards_only: bool  # distillation without env rewards: every trajectory that did not fail trains on 0
    overlong_buffer: int  # DAPO's soft overlong punishment (rollout.overlong_*)
    overlong_penalty: float
    overlong_filtering: bool
    dynamic_filtering: bool  # drop groups without signal (never while distilling)
    recompute_logprobs: bool  # old log-probs from the actor (else the engine's sampling log-probs)
    proximal_from_update: bool  # they come from the update's own forward pass (after actor.freeze_steps)
    correction: Correction  # the rollout correction
    actor: ActorConfig
    adv: AdvConfig
    kl: KLConfig | None
    distill: DistillConfig | None
    critic: CriticConfig | None

    @classmethod
    def from_config(cls, config: Config, train_max_new_tokens: int) -> "StepPlan":
        """The plan of a PPO run; `train_max_new_tokens`: the rollout's training sampling params' limit."""
        kl = config.kl if config.kl.coef > 0 else None
        distill = config.distill if config.distill.coef > 0 else None
        correction = rollout_correction(config.actor, config.rollout)
        actor = config.actor
        scored_by_env = config.rollout.env_path is not None or config.rollout.agent_path is not None
        group_size = config.data.responses_per_prompt
        return cls(
            seed=config.trainer.seed,
            group_size=group_size,
            generated_per_prompt=config.generated_per_prompt,
            train_max_new_tokens=train_max_new_tokens,
            scored_by_env=scored_by_env,
            teacher_rewards_only=distill is not None and not (distill.env_reward and scored_by_env),
            overlong_buffer=config.rollout.overlong_buffer,
            overlong_penalty=config.rollout.overlong_penalty,
            overlong_filtering=config.rollout.overlong_filtering,
            dynamic_filtering=config.rollout.dynamic_filtering and distill is None,
            recompute_logprobs=actor.recompute_logprobs,
            # The batch trains in one minibatch, so that pass is the proximal policy's, and nothing reads the
            # old log-probs before it (no correction, no teacher, no KL in the reward).
            proximal_from_update=(actor.recompute_logprobs and actor.proximal_from_update
                                  and actor.update_per_rollout == 1 and correction.mode == "none"
                                  and distill is None and (kl is None or kl.type != "reward")),
            correction=correction,
            actor=actor,
            adv=config.adv,
            kl=kl,
            distill=distill,
            critic=config.critic if config.adv.estimator == "gae" else None,
        )

    def proximal_in_update(self, step: int) -> bool:
        """Whether step `step`'s old log-probs come from its update's forward pass (the actor trains in it)."""
        return self.proximal_from_update and step > self.actor.freeze_steps

    @property
    def shapes_overlong(self) -> bool:
        return self.overlong_buffer > 0 or self.overlong_filtering
