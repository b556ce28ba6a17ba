"""What every trainer shares: process group, logging, metrics, checkpoint save and resume."""

import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer

from rl2.check_run import CHECK_FLAG, run_check
from rl2.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    find_latest_checkpoint,
    load_checkpoint,
    load_optimizer_state,
    resolve_checkpoint,
    save_checkpoint,
    save_hf_model,
    start_checkpoint,
)
from rl2.config import Config, ConfigError, ModelConfig, config_to_dict, load_config
from rl2.config.commands import command_named
from rl2.data.rows import Columns, DataError, load_rows, split_rows, validate_rows
from rl2.distributed.process_group import (
    PEER_GONE,
    broadcast_from_rank0,
    exit_process,
    init_distributed,
    is_rank0,
    rank,
    world_size,
)
from rl2.launch import INTERRUPTED_EXIT, USER_ERROR_EXIT
from rl2.metrics import MetricsLogger
from rl2.report import write_report
from rl2.rollout.env import EnvError
from rl2.run_folder import check_run_folder, claim_run_folder

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


USER_ERRORS = (ConfigError, DataError, EnvError, CheckpointError)  # mistakes a user can fix
# A rank other than 0 waits this long before printing its error: when rank 0 has the same one (a config
# or data error every rank meets), torchrun stops this rank first and only rank 0's line is shown.
PEER_REPORT_DELAY_S = 10.0


def stop_on_user_error(error: Exception) -> None:
    """End this rank with one `rl2: error: ...` line and exit code 2, skipping interpreter teardown
    (a peer may already be gone: no barrier, no process-group shutdown)."""
    this_rank = rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", "0"))
    if this_rank != 0:
        time.sleep(PEER_REPORT_DELAY_S)
    where = f"[rank {this_rank}] " if this_rank != 0 else ""
    print(f"rl2: error: {where}{error}", file=sys.stderr, flush=True)
    os._exit(USER_ERROR_EXIT)


def interrupted_line(config: Config | None, command: str) -> str:
    """What rank 0 says on Ctrl-C: where the run's last complete checkpoint is and how to resume."""
    section = command_named(command).checkpoints
    if config is None or section is None or config.trainer.eval_only:
        return "rl2: interrupted"
    save_dir = getattr(config, section).save_dir
    latest = find_latest_checkpoint(save_dir)
    if latest is None:
        return (f"rl2: interrupted before the first checkpoint in {save_dir} ({section}.save_freq sets how often); "
                f"trainer.load_ckpt_from=latest starts it again there")
    return f"rl2: interrupted; the last checkpoint is {latest}: resume with trainer.load_ckpt_from=latest"


def run_main(run: Callable[[Config], Any], command: str) -> None:
    """The command-line entry point of every `python -m rl2...` module: `run` the config parsed from
    `sys.argv` for `command` (a name in `rl2.config.commands.COMMANDS`).

    A mistake the user can fix (a bad config, data, env file or checkpoint) ends every rank with one
    `rl2: error:` line from rank 0 and exit code 2; Ctrl-C (or torchrun forwarding it) ends every rank
    with one line from rank 0 saying where to resume, exit code 130; a rank whose peer exited first
    stops with exit code 1 and one line naming itself (the peer says why it exited). Under `rl2run`
    nothing else is printed for the first two. With `--check` among the arguments nothing runs: the
    config, files, data and models are checked (`rl2.check_run`), exit code 0 or a user error."""
    config: Config | None = None

    def on_interrupt(signum, frame) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun forwards a second one
        if rank() == 0:
            print(f"\n{interrupted_line(config, command)}", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED_EXIT)

    signal.signal(signal.SIGINT, on_interrupt)
    try:
        if CHECK_FLAG in sys.argv[1:]:  # `--check`: the config, files, data and models checked, nothing run
            run_check(sys.argv[1:], command)
        else:
            config = load_config(sys.argv[1:], command)
            run(config)
    except USER_ERRORS as error:
        stop_on_user_error(error)
    except RuntimeError as error:
        if any(sign in str(error) for sign in PEER_GONE):
            stop_after_peer_exit(error)
        raise
    exit_process(0)


def stop_after_peer_exit(error: RuntimeError) -> None:
    """End this rank with exit code 1 and one line naming it and the error, when a peer rank exited
    while this one still needed it (the peer's own output says why it exited, if it failed)."""
    this_rank = int(os.environ.get("RANK", "0"))  # torchrun's: split placement's sides number their ranks anew
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    where = next((f" in {frame.name} ({frame.filename}:{frame.lineno})" for frame in reversed(frames)
                  if f"{os.sep}torch{os.sep}" not in frame.filename), "")  # the call that met the closed connection
    print(f"rl2 [rank {this_rank}]: stopped: another rank exited while this one still worked with it{where}: "
          f"{first_line}", file=sys.stderr, flush=True)
    os._exit(1)


def start_run(config: Config, main_section: str = "actor"):
    """What every entry point does once its config is checked (`rl2.config_checks`), before its work:
    the process group, rank-0 logging, the seed, `sp_size` against the world size. Returns the
    tokenizer of the run's main model (`<main_section>.tokenizer_name`, else its `model_name`)."""
    init_distributed()
    setup_logging()
    for section in ("actor", "critic"):
        sp_size = getattr(config, section).sp_size
        if sp_size < 1 or world_size() % sp_size != 0:
            raise ConfigError(f"{section}.sp_size={sp_size} must divide the number of ranks ({world_size()})")
    torch.manual_seed(config.trainer.seed)
    main = getattr(config, main_section)
    return AutoTokenizer.from_pretrained(main.tokenizer_name or main.model_name)


class Trainer:
    """Base of the trainers: holds the config, the tokenizer and the metrics logger; saves and resumes.

    Subclasses build their models, set `self.total_steps`, list what a checkpoint holds in
    `checkpointed_models()` (keyed by config section), and call `resume()` once their models and
    sampler exist. `main_section` names the model a run is about: its tokenizer is the run's, its
    `save_dir`, `save_freq` and `save_optimizer` rule the checkpoints, and the checkpoint folder
    holds it at its root (other models in sub-folders named after their section). `name` is the
    run's kind (e.g. "SFT"), recorded in the folder's run marker.
    """

    name: str
    main_section = "actor"

    def __init__(self, config: Config):
        self.config = config
        self.tokenizer = start_run(config, self.main_section)
        if not config.trainer.eval_only:
            self.check_save_dir()
        self.step = 0
        self.metrics: MetricsLogger | None = None
        self.closed = False

    def check_save_dir(self) -> None:
        """Before any model loads: stop with a ConfigError when the checkpoint folder holds another
        run that this one neither resumes nor overwrites (`rl2.run_folder`); decided on rank 0, so
        that every rank stops or none does."""
        trainer = self.config.trainer
        error = None
        if is_rank0():
            error = check_run_folder(self.main_config.save_dir, f"{self.main_section}.save_dir",
                                     resume=trainer.load_ckpt_from is not None, overwrite=trainer.overwrite)
        error = broadcast_from_rank0(error)
        if error is not None:
            raise ConfigError(error)

    def load_datasets(self, dataset_cls: type, max_length: int | None, tools: dict | None = None) -> tuple:
        """(train, test or None) from `data.path`, `data.test_path` or a `data.test_ratio` split (none
        when `test_ratio` of the rows rounds to no row: the run trains on them all); `tools`: the env
        file's, which the prompts are rendered with."""
        data, tokenizer = self.config.data, self.tokenizer
        columns = Columns.for_run(self.config, dataset_cls.kind)  # RL2 HEAD env files: rows need no prompt
        if data.test_path is not None:
            return (dataset_cls(data.path, tokenizer, max_length, columns=columns, tools=tools),
                    dataset_cls(data.test_path, tokenizer, max_length, columns=columns, tools=tools))
        if data.test_ratio > 0:
            rows = load_rows(data.path)
            if round(len(rows) * data.test_ratio) < 1:
                logger.info(f"data.test_ratio={data.test_ratio} of {len(rows)} rows is under half a row: no test set")
                return dataset_cls(rows, tokenizer, max_length, source=data.path, columns=columns, tools=tools), None
            validate_rows(rows, dataset_cls.kind, data.path, columns)  # before the split, so errors name the file's rows
            train_rows, test_rows = split_rows(rows, data.test_ratio, self.config.trainer.seed)
            return (
                dataset_cls(train_rows, tokenizer, max_length, source=data.path, columns=columns, tools=tools),
                dataset_cls(test_rows, tokenizer, max_length, source=f"{data.path} (test split)", columns=columns, tools=tools),
            )
        return dataset_cls(data.path, tokenizer, max_length, columns=columns, tools=tools), None

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
        """Make the checkpoint folder this run's (`rl2.run_folder`: with `trainer.overwrite` the previous
        run's outputs are deleted now), restore from `trainer.load_ckpt_from` if set, then open the
        metrics log at that step."""
        save_dir, trainer = self.main_config.save_dir, self.config.trainer
        if is_rank0():
            claim_run_folder(save_dir, self.name.lower(), trainer.experiment_name,
                             resume=trainer.load_ckpt_from is not None, overwrite=trainer.overwrite)
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
            tensorboard=self.config.trainer.tensorboard,
            enabled=is_rank0(),
            resume_step=self.step,
        )

    def save(self, step: int) -> str:
        """Write the checkpoint of `step`: HF folders for users, sharded state to resume from, and last
        the completeness marker (a re-save of a step removes its marker first: `start_checkpoint`)."""
        path = checkpoint_dir(self.main_config.save_dir, step)
        start_checkpoint(path)
        models = self.checkpointed_models()
        for name, (model, _) in models.items():
            model_path = path if name == self.main_section else os.path.join(path, name)
            section = getattr(self.config, name)
            save_hf_model(model, model_path, section.dtype, self.tokenizer, merged=section.lora.save_merged)
        if not self.main_config.save_optimizer:
            models = {name: (model, None) for name, (model, _) in models.items()}
        save_checkpoint(path, models, {"step": step, **self.extra_state()})
        return path

    def close(self) -> None:
        """End the run (once): the metrics' sinks closed (wandb finished, TensorBoard flushed), the run's
        report written, and what it holds outside this process released (`release`)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.metrics is not None:
                self.metrics.finish()
                if self.metrics.enabled:  # rank 0
                    try:
                        logger.info(f"report: {write_report([self.metrics.save_dir])}")
                    except Exception as error:  # the run's outputs are written; a failed report must not fail it
                        logger.warning(f"the report could not be written: {type(error).__name__}: {error}")
        finally:
            self.release()

    def close_after_error(self) -> None:
        """End a run that failed: what it holds released, nothing more written."""
        if not self.closed:
            self.closed = True
            self.release()

    def release(self) -> None:
        """Stop what the run holds outside this process (an engine, env worker processes); none here."""

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, error_type, error, trace) -> None:
        """`with Trainer(config) as trainer:` closes the run at the end of the block (after an error: stops it)."""
        if error_type is None:
            self.close()
        else:
            self.close_after_error()

    def should_save(self, step: int) -> bool:
        freq = self.main_config.save_freq
        return step == self.total_steps or (freq is not None and step % freq == 0)
