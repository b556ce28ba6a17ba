"""What each command reads: the config keys its entry point uses.

A key given on the command line to a command that does not read it is an error naming the command
(`rl2.trainer.rm actor.save_dir=x` would otherwise save to `critic.save_dir` without a word), and each
command's `--help` lists only its keys. A YAML file may be shared by several commands (a recipe's
`config.yaml` serves training, the difficulty filter and evaluation): the keys it sets that a
command does not read are named in one note instead.
"""

from dataclasses import dataclass

# Model keys only the RL update reads (minibatches, clipping, frozen first steps, loss averaging).
RL_MODEL_KEYS = ("update_per_rollout", "clip", "clip_high", "loss_level", "loss_agg", "loss_agg_norm", "freeze_steps")
# Actor keys only the RL update reads (its policy loss, corrections and entropy bonus).
RL_ACTOR_KEYS = ("recompute_logprobs", "clip_c", "policy_loss", "gspo_clip", "gspo_clip_high", "rollout_correction",
                 "correction_threshold", "icepop_low", "icepop_high", "rejected_tokens", "tis_coef", "entropy_coef")
DPO_KEYS = ("beta", "label_smoothing")
# What the loops over a fixed dataset (SFT, RM, DPO) read of `data` and `trainer`.
OFFLINE_DATA = tuple(f"data.{key}" for key in (
    "path", "test_path", "test_ratio", "max_length", "batch_size", "shuffle", "messages_key", "apply_chat_template"))
OFFLINE_TRAINER_IGNORES = ("trainer.eval_only", "trainer.dump_trajectories")
# What the sampling-only commands (difficulty filter, search) read of the policy: the engine serves it.
ENGINE_MODEL = tuple(f"actor.{key}" for key in ("model_name", "tokenizer_name", "dtype", "max_length_per_device", "sp_size"))
# Rollout keys only training reads: partial rollout and DAPO's reward shaping.
PARTIAL_AND_SHAPING = tuple(f"rollout.{key}" for key in (
    "partial_rollout", "partial_extra_prompts", "partial_max_age", "overlong_buffer", "overlong_penalty",
    "overlong_filtering", "placement", "ranks", "max_staleness"))
RL_DATA = tuple(f"data.{key}" for key in (
    "path", "max_length", "batch_size", "prompts_per_rollout", "messages_key", "apply_chat_template", "prompt_key"))


def _model(section: str, *ignored: str) -> tuple[str, ...]:
    return tuple(f"{section}.{key}" for key in ignored)


@dataclass(frozen=True)
class Command:
    """A command-line entry point and the config keys it reads: `reads` holds sections (all their
    keys) and `section.key`s; `ignores` the keys inside a read section that it does not use."""

    name: str
    module: str
    reads: tuple[str, ...]
    ignores: tuple[str, ...] = ()
    checkpoints: str | None = None  # the section whose save_dir holds the run's checkpoints
    note: str = ""  # said with a key it does not read

    def reads_key(self, key: str) -> bool:
        """Whether `key` (`section.key`, or deeper inside a free-form dict) is read by this command."""
        section, _, rest = key.partition(".")
        name = f"{section}.{rest.partition('.')[0]}" if rest else section
        if name in self.ignores:
            return False
        return section in self.reads or name in self.reads

    def reads_section(self, section: str) -> bool:
        """Whether any key of `section` (`actor`, or a nested one: `actor.lora`) is read."""
        return (section.partition(".")[0] in self.reads and self.reads_key(section + ".x")) or any(
            key.startswith(section + ".") for key in self.reads)

    @property
    def launch(self) -> str:
        return f"torchrun --nproc_per_node=N -m {self.module}"


COMMANDS: dict[str, Command] = {command.name: command for command in (
    Command("ppo", "rl2.trainer.ppo", ("data", "actor", "critic", "ref_actor", "rollout", "kl", "teacher", "distill",
                                      "adv", "trainer"),
            ignores=(*_model("actor", *DPO_KEYS), "critic.logps_chunk_size"), checkpoints="actor"),
    Command("sft", "rl2.trainer.sft", (*OFFLINE_DATA, "actor", "trainer"),
            ignores=(*_model("actor", *RL_MODEL_KEYS, *DPO_KEYS, *RL_ACTOR_KEYS), *OFFLINE_TRAINER_IGNORES),
            checkpoints="actor"),
    Command("rm", "rl2.trainer.rm", (*OFFLINE_DATA, "critic", "trainer"),
            ignores=(*_model("critic", *RL_MODEL_KEYS, "logps_chunk_size"), *OFFLINE_TRAINER_IGNORES),
            checkpoints="critic", note="rl2.trainer.rm trains the reward model in the critic section "
                                       "(critic.model_name, critic.lr, critic.save_dir, ...), as RL2 does"),
    Command("dpo", "rl2.trainer.dpo", (*OFFLINE_DATA, "actor", "ref_actor", "trainer"),
            ignores=(*_model("actor", *RL_MODEL_KEYS, *RL_ACTOR_KEYS), *OFFLINE_TRAINER_IGNORES),
            checkpoints="actor"),
    Command("filter", "rl2.trainer.difficulty_filter", (*RL_DATA, *ENGINE_MODEL, "rollout", "trainer.seed", "filter"),
            ignores=("rollout.dynamic_filtering", "rollout.oversample", "rollout.test_responses_per_prompt",
                     "rollout.sync_bucket_mb", *PARTIAL_AND_SHAPING)),
    Command("search", "rl2.search", (*RL_DATA, *ENGINE_MODEL, "rollout", "trainer.seed", "search"),
            ignores=("rollout.dynamic_filtering", "rollout.oversample", "rollout.test_responses_per_prompt",
                     "rollout.sync_bucket_mb", "rollout.max_unscored_steps", *PARTIAL_AND_SHAPING)),
)}


def command_named(name: str) -> Command:
    if name not in COMMANDS:
        raise ValueError(f"unknown command {name!r}; expected one of {', '.join(COMMANDS)}")
    return COMMANDS[name]
