"""What every trainer shares: process group, logging, metrics, checkpoint save and resume."""

import contextlib
import logging
import os
import sys

import torch
from transformers import AutoTokenizer

from rl2.checkpoint import (
    checkpoint_dir,
    load_checkpoint,
    load_optimizer_state,
    resolve_checkpoint,
    save_checkpoint,
    save_hf_model,
)
from rl2.config import Config, ConfigError, ModelConfig, config_to_dict
from rl2.data.rows import DataError, load_rows, split_rows, validate_rows
from rl2.rollout.env import EnvError
from rl2.distributed.process_group import init_distributed, is_rank0, world_size
from rl2.metrics import MetricsLogger

logger = logging.getLogger(__name__)


def setup_logging() -> None:
    """Info logs from rank 0, warnings and errors from every rank, on the `rl2` logger only."""
    rl2_logger = logging.getLogger("rl2")
    rl2_logger.setLevel(logging.INFO if is_rank0() else logging.WARNING)
    if not rl2_logger.handlers:
        handler = logging.StreamHandler()
        prefix = "" if world_size() == 1 else f"[rank{torch.distributed.get_rank()}] "
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(name)s: %(message)s", "%H:%M:%S"))
        rl2_logger.addHandler(handler)
        rl2_logger.propagate = False


@contextlib.contextmanager
def user_errors_reported():
    """Command-line entry points: a bad config or data file ends the run with its message, not a traceback."""
    try:
        yield
    except (ConfigError, DataError, EnvError) as error:
        print(f"rl2: error: {error}", file=sys.stderr)
        sys.exit(2)


def require(config: Config, *keys: str) -> None:
    """Fail before anything starts when a key the trainer cannot run without is unset."""
    for key in keys:
        section, name = key.split(".")
        if getattr(getattr(config, section), name) is None:
            raise ConfigError(f"{key} is required (pass {key}=...)")


def check_local_model_path(name: str | None, key: str) -> None:
    """A model name that is clearly a path (absolute, ./ or ../, or more than one `/`, which no Hub
    id has) must be an existing folder: otherwise transformers reports it as a malformed repo id."""
    if name is None:
        return
    looks_local = os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
    if looks_local and not os.path.isdir(os.path.expanduser(name)):
        raise ConfigError(f"{key}={name}: no such model folder")


def require_pair_budget(config: Config, section: str) -> None:
    """Pair trainers: a pair (chosen and rejected, up to `data.max_length` tokens each) must fit in
    one micro-batch, since both are packed side by side."""
    model = getattr(config, section)
    budget = model.max_length_per_device * model.sp_size
    if config.data.max_length is not None and 2 * config.data.max_length > budget:
        raise ConfigError(
            f"data.max_length={config.data.max_length} allows pairs of {2 * config.data.max_length} tokens (chosen and "
            f"rejected share a micro-batch), more than {section}.max_length_per_device x {section}.sp_size = {budget}; "
            f"raise {section}.max_length_per_device or lower data.max_length"
        )


def start_run(config: Config, main_section: str = "actor"):
    """What every entry point does before its work: the process group, rank-0 logging, the seed, checks
    of the model paths and of `sp_size` against the world size. Returns the tokenizer of the run's
    main model (`<main_section>.tokenizer_name`, else its `model_name`)."""
    init_distributed()
    setup_logging()
    for section in ("actor", "critic"):
        sp_size = getattr(config, section).sp_size
        if sp_size < 1 or world_size() % sp_size != 0:
            raise ConfigError(f"{section}.sp_size={sp_size} must divide the number of ranks ({world_size()})")
    torch.manual_seed(config.trainer.seed)
    for section in ("actor", "critic"):
        check_local_model_path(getattr(config, section).model_name, f"{section}.model_name")
    main = getattr(config, main_section)
    return AutoTokenizer.from_pretrained(main.tokenizer_name or main.model_name)


class Trainer:
    """Base of the trainers: holds the config, the tokenizer and the metrics logger; saves and resumes.

    Subclasses build their models, set `self.total_steps`, list what a checkpoint holds in
    `checkpointed_models()` (keyed by config section), and call `resume()` once their models and
    sampler exist. `main_section` names the model a run is about: its tokenizer is the run's, its
    `save_dir`, `save_freq` and `save_optimizer` rule the checkpoints, and the checkpoint folder
    holds it at its root (other models in sub-folders named after their section).
    """

    main_section = "actor"

    def __init__(self, config: Config):
        self.config = config
        self.tokenizer = start_run(config, self.main_section)
        self.step = 0
        self.metrics: MetricsLogger | None = None

    def load_datasets(self, dataset_cls: type, max_length: int | None) -> tuple:
        """(train, test or None) from `data.path`, `data.test_path` or a `data.test_ratio` split."""
        data, tokenizer = self.config.data, self.tokenizer
        if data.test_path is not None:
            return dataset_cls(data.path, tokenizer, max_length), dataset_cls(data.test_path, tokenizer, max_length)
        if data.test_ratio > 0:
            rows = load_rows(data.path)
            validate_rows(rows, dataset_cls.kind, data.path)  # before the split, so errors name the file's rows
            train_rows, test_rows = split_rows(rows, data.test_ratio, self.config.trainer.seed)
            return (
                dataset_cls(train_rows, tokenizer, max_length, source=data.path),
                dataset_cls(test_rows, tokenizer, max_length, source=f"{data.path} (test split)"),
            )
        return dataset_cls(data.path, tokenizer, max_length), None

    @property
    def main_config(self) -> ModelConfig:
        return getattr(self.config, self.main_section)

    def is_test_step(self, step: int) -> bool:
        freq = self.config.trainer.test_freq
        return step == self.total_steps or (freq is not None and step % freq == 0)

    # subclasses override
    def checkpointed_models(self) -> dict:
        raise NotImplementedError

    def extra_state(self) -> dict:
        """Trainer state besides the models (data position, schedulers)."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    def resume(self) -> None:
        """Restore from `trainer.load_ckpt_from` if set, then open the metrics log at that step."""
        save_dir = self.main_config.save_dir
        path = resolve_checkpoint(self.config.trainer.load_ckpt_from, save_dir)
        if path is not None:
            state = load_checkpoint(path, self.checkpointed_models())
            self.step = state["step"]
            self.load_extra_state(state)
            logger.info(f"resumed from {path} at step {self.step}")
        else:
            if self.config.trainer.load_ckpt_from == "latest":
                logger.info(f"no checkpoint under {save_dir} yet: starting from scratch")
            for name, (model, optimizer) in self.checkpointed_models().items():
                optimizer_dir = getattr(self.config, name).optimizer_dir
                if optimizer_dir is not None:
                    load_optimizer_state(optimizer_dir, name, model, optimizer)
                    logger.info(f"{name} optimizer state loaded from {optimizer_dir}")
        self.metrics = MetricsLogger(
            save_dir=save_dir,
            project=self.config.trainer.project,
            experiment_name=self.config.trainer.experiment_name,
            config=config_to_dict(self.config),
            disable_wandb=self.config.trainer.disable_wandb,
            enabled=is_rank0(),
            resume_step=self.step,
        )

    def save(self, step: int) -> str:
        """Write the checkpoint of `step`: HF folders for users, sharded state to resume from."""
        path = checkpoint_dir(self.main_config.save_dir, step)
        models = self.checkpointed_models()
        for name, (model, _) in models.items():
            model_path = path if name == self.main_section else os.path.join(path, name)
            save_hf_model(model, model_path, getattr(self.config, name).dtype, self.tokenizer)
        if not self.main_config.save_optimizer:
            models = {name: (model, None) for name, (model, _) in models.items()}
        save_checkpoint(path, models, {"step": step, **self.extra_state()})
        return path

    def should_save(self, step: int) -> bool:
        freq = self.main_config.save_freq
        return step == self.total_steps or (freq is not None and step % freq == 0)
