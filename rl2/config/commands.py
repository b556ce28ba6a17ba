"""What each command reads: the config keys its entry point uses.

A key given on the command line to a command that does not read it is an error naming the command
(`rl2.trainer.rm actor.save_dir=x` would otherwise save to `critic.save_dir` without a word), and each
command's `--help` lists only its keys. A YAML file may be shared by several commands (a recipe's
`config.yaml` serves training, the difficulty filter and evaluation): the keys it sets that a
command does not read are named in one note instead.
"""

from dataclasses import dataclass, fields, is_dataclass

# What a key is for, as its field's `only` tag in `rl2.config` says; untagged keys are read by every command
# that reads their section. A command skips the tags of what it does not do.
SAMPLING = "sampling"  # the prompts an engine answers (not the loops over a fixed dataset)
TRAINING = "training"  # a training run: the model's optimizer, sharding, checkpoints, test split (not sampling alone)
RL = "rl"  # training on sampled rollouts: the update's minibatches and clipping, reward shaping, partial rollouts
POLICY_LOSS = "policy_loss"  # the RL policy loss, its rollout corrections and entropy bonus
DPO = "dpo"  # the DPO loss
IMAGES = "images"  # rows with images for a vision-language model: SFT, PPO, DPO, RM (issue 68)


def _key_tag(key: str) -> str | None:
    """The `only` tag of the field `key` (`section.key`); None for a section or a key that is no field."""
    from rl2.config import Config  # rl2.config imports this module before it defines the sections

    cls, tag = Config, None
    for part in key.split("."):
        match = [f for f in fields(cls) if f.name == part] if is_dataclass(cls) else []
        if not match:
            return None
        cls, tag = match[0].type, match[0].metadata.get("only")
    return tag


@dataclass(frozen=True)
class Command:
    """A command-line entry point and the config keys it reads: `reads` holds sections (all their
    keys) and `section.key`s; `skips` the tags (above) of the keys inside a read section that it does
    not use, and `ignores` the other such keys."""

    name: str
    module: str
    reads: tuple[str, ...]
    skips: tuple[str, ...] = ()
    ignores: tuple[str, ...] = ()
    checkpoints: str | None = None  # the section whose save_dir holds the run's checkpoints
    note: str = ""  # said with a key it does not read

    def reads_key(self, key: str) -> bool:
        """Whether `key` (`section.key`, or deeper inside a free-form dict) is read by this command."""
        section, _, rest = key.partition(".")
        name = f"{section}.{rest.partition('.')[0]}" if rest else section
        if name in self.ignores or _key_tag(name) in self.skips:
            return False
        return section in self.reads or name in self.reads

    def reads_section(self, section: str) -> bool:
        """Whether any key of `section` (`actor`, or a nested one: `actor.lora`) is read."""
        return (section.partition(".")[0] in self.reads and self.reads_key(section + ".x")) or any(
            key.startswith(section + ".") for key in self.reads)

    @property
    def launch(self) -> str:
        return f"torchrun --nproc_per_node=N -m {self.module}"


# The loops over a fixed dataset (SFT, RM, DPO) sample nothing; the difficulty filter and the search train nothing.
OFFLINE = (SAMPLING, RL, POLICY_LOSS)
SAMPLING_ONLY = (TRAINING, RL, POLICY_LOSS, DPO, IMAGES)

COMMANDS: dict[str, Command] = {command.name: command for command in (
    Command("ppo", "rl2.trainer.ppo", ("data", "actor", "critic", "ref_actor", "rollout", "kl", "teacher", "distill",
                                      "adv", "trainer"),
            skips=(DPO,), ignores=("critic.logps_chunk_size",), checkpoints="actor"),
    Command("sft", "rl2.trainer.sft", ("data", "actor", "trainer"), skips=(*OFFLINE, DPO), checkpoints="actor"),
    # POLICY_LOSS is not skipped: critic.clip_c (inherited from ModelConfig, unused by a critic) stays accepted
    Command("rm", "rl2.trainer.rm", ("data", "critic", "trainer"), skips=(SAMPLING, RL),
            ignores=("critic.logps_chunk_size",),
            checkpoints="critic", note="rl2.trainer.rm trains the reward model in the critic section "
                                       "(critic.model_name, critic.lr, critic.save_dir, ...), as RL2 does"),
    Command("dpo", "rl2.trainer.dpo", ("data", "actor", "ref_actor", "trainer"), skips=OFFLINE, checkpoints="actor"),
    Command("filter", "rl2.trainer.difficulty_filter", ("data", "actor", "rollout", "trainer.seed", "filter"),
            skips=SAMPLING_ONLY),
    Command("search", "rl2.search", ("data", "actor", "rollout", "trainer.seed", "search"),
            skips=SAMPLING_ONLY, ignores=("rollout.max_unscored_steps",)),
)}


def command_named(name: str) -> Command:
    if name not in COMMANDS:
        raise ValueError(f"unknown command {name!r}; expected one of {', '.join(COMMANDS)}")
    return COMMANDS[name]
