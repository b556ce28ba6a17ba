"""Checkpoints: a Hugging Face model folder for users, plus sharded state for an exact resume.

Layout of `<save_dir>/step<N>/`:
- `config.json`, `model.safetensors`, tokenizer files: the actor, loadable with `from_pretrained`
  (other models, e.g. a critic, in sub-folders named after them);
- `dcp/`: model (fp32 master weights) and optimizer shards, written with torch.distributed.checkpoint;
- `trainer_state.json`: step, data position, schedulers. The completeness marker: rank 0 writes it
  last, once every rank has written its shards, atomically (a temporary file renamed into place), and a
  re-save of a step removes it first, before any rank writes. A save cut short (a killed rank) leaves
  the folder without it, and `trainer.load_ckpt_from=latest` takes the previous complete step.

A folder is taken as complete when its `trainer_state.json` is a JSON object and every shard file its
`dcp/.metadata` lists is there in full (`checkpoint_problem`): checkpoints written before the marker
was written atomically resume as before, unless a save tore them.
"""

import json
import logging
import os
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rl2.distributed.fsdp import DTYPES, gather_full_state_dict
from rl2.distributed.process_group import barrier, is_rank0
from rl2.lora import adapted_weights, base_model, is_lora, merged_state_dict, save_adapter

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"  # the completeness marker, written last


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (missing, incomplete, or of another model); the message
    names the folder and the key that pointed there."""


def checkpoint_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step{step}")


def checkpoint_problem(path: str) -> str | None:
    """Why the folder `path` is not a complete checkpoint, in words (None when it is one): its
    `trainer_state.json` missing or not a JSON object, or `dcp/` without its metadata or with a shard
    file missing or shorter than the metadata says (a save torn by a killed rank)."""
    text = ""
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            text = f.read()
        state = json.loads(text)
    except FileNotFoundError:
        return f"{STATE_FILE}, written last when a save completes, is missing"
    except (OSError, ValueError) as error:
        what = "is empty" if not text.strip() else f"cannot be read ({_first_line(error)})"
        return f"{STATE_FILE} {what}: a save was cut short"
    if not isinstance(state, dict) or "step" not in state:
        return f"{STATE_FILE} holds no step: a save was cut short"
    dcp_dir = os.path.join(path, "dcp")
    try:
        storage = dcp.FileSystemReader(dcp_dir).read_metadata().storage_data
    except Exception as error:  # a missing, empty or truncated .metadata: pickle's errors vary
        return f"dcp/.metadata cannot be read ({_first_line(error)})"
    lengths: dict[str, int] = {}  # each shard file's least size: its last item's end
    for info in storage.values():
        lengths[info.relative_path] = max(lengths.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(lengths.items()):
        size = os.path.getsize(os.path.join(dcp_dir, name)) if os.path.isfile(os.path.join(dcp_dir, name)) else None
        if size is None or size < length:
            found = "missing" if size is None else f"{size} of its {length} bytes"
            return f"the shard dcp/{name} is {found}: a save was cut short"
    return None


def find_latest_checkpoint(save_dir: str) -> str | None:
    """The complete checkpoint (`checkpoint_problem`) with the highest step under `save_dir`, or None.
    Rank 0 warns of the incomplete `step<N>/` folders above it, naming them, why, and the one picked."""
    if not os.path.isdir(save_dir):
        return None
    steps = sorted((int(match.group(1)) for name in os.listdir(save_dir) if (match := re.fullmatch(r"step(\d+)", name))
                    and os.path.isdir(os.path.join(save_dir, name))), reverse=True)
    skipped = []
    for step in steps:
        path = checkpoint_dir(save_dir, step)
        problem = checkpoint_problem(path)
        if problem is None:
            if skipped and is_rank0():
                logger.warning(f"skipping incomplete checkpoints ({'; '.join(skipped)}): the latest complete one is {path}")
            return path
        skipped.append(f"{path}: {problem}")
    if skipped and is_rank0():
        logger.warning(f"skipping incomplete checkpoints ({'; '.join(skipped)}): no complete one under {save_dir}")
    return None


def resolve_checkpoint(load_ckpt_from: str | None, save_dir: str) -> str | None:
    """`trainer.load_ckpt_from`: None (fresh start), `latest` (None if there is none yet) or a folder."""
    if load_ckpt_from is None:
        return None
    if load_ckpt_from == "latest":
        return find_latest_checkpoint(save_dir)
    problem = checkpoint_problem(load_ckpt_from)
    if problem is not None:
        if not os.path.isdir(load_ckpt_from):
            raise CheckpointError(f"trainer.load_ckpt_from={load_ckpt_from}: no such folder")
        complete = find_latest_checkpoint(load_ckpt_from)
        hint = f" (it holds checkpoints: the last complete one is {complete})" if complete else ""
        raise CheckpointError(f"trainer.load_ckpt_from={load_ckpt_from} is not a complete checkpoint: {problem}{hint}")
    return load_ckpt_from


def save_hf_model(model: nn.Module, path: str, dtype: str, tokenizer=None, merged: bool = False) -> None:
    """Gather the full weights on rank 0 and write a `from_pretrained`-loadable folder (all ranks call this).
    A LoRA model writes its adapter in peft's format instead (`PeftModel.from_pretrained(base, path)`) and,
    with `merged`, the merged model in `path/merged`."""
    state_dict = gather_full_state_dict(model)
    if not is_rank0():
        return
    torch_dtype = DTYPES[dtype]
    state_dict = {k: v.to(torch_dtype) for k, v in state_dict.items()}
    if is_lora(model):
        save_adapter(model, state_dict, path)
        if merged:
            base = base_model(model)
            base.config.dtype = torch_dtype
            base.save_pretrained(os.path.join(path, "merged"), state_dict=merged_state_dict(state_dict, adapted_weights(model)))
            if tokenizer is not None:
                tokenizer.save_pretrained(os.path.join(path, "merged"))
    else:
        model.config.dtype = torch_dtype
        model.save_pretrained(path, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def start_checkpoint(path: str) -> None:
    """Before any rank writes the checkpoint folder `path` (all ranks call this): rank 0 removes the
    completeness marker of an earlier save of that step, so that a re-save cut short leaves the folder
    incomplete rather than an old marker beside new, partial shards."""
    if is_rank0():
        os.makedirs(path, exist_ok=True)
        marker = os.path.join(path, STATE_FILE)
        if os.path.lexists(marker):
            os.remove(marker)
            _fsync_dir(path)
            logger.info(f"saving step folder {path} again: its earlier checkpoint is replaced")
    barrier()


def save_checkpoint(
    path: str,
    models: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]],
    trainer_state: dict,
) -> None:
    """Write the sharded state of `models` ({name: (model, optimizer or None)}), then, once every rank has
    written its shards, `trainer_state` on rank 0: the completeness marker, written atomically.
    Call `start_checkpoint(path)` before anything is written to `path`."""
    state = {}
    for name, (model, optimizer) in models.items():
        state[f"{name}.model"] = get_model_state_dict(model)
        if optimizer is not None:
            state[f"{name}.optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=os.path.join(path, "dcp"))
    barrier()
    if is_rank0():
        temporary = os.path.join(path, f"{STATE_FILE}.tmp")
        with open(temporary, "w") as f:
            json.dump(trainer_state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, os.path.join(path, STATE_FILE))
        _fsync_dir(path)
    barrier()
    logger.info(f"checkpoint saved to {path}")


def _fsync_dir(path: str) -> None:
    """Make a file's creation, rename or removal in the folder `path` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def load_checkpoint(path: str, models: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]]) -> dict:
    """Restore `models` in place from `path` and return its trainer state.

    An optimizer whose state was not saved (`save_optimizer=false`) starts fresh, with a warning.
    """
    saved_keys = set(_read_saved_keys(path))
    state = {}
    for name, (model, optimizer) in models.items():
        state[f"{name}.model"] = get_model_state_dict(model)
        if optimizer is not None and any(k.startswith(f"{name}.optimizer.") for k in saved_keys):
            state[f"{name}.optimizer"] = get_optimizer_state_dict(model, optimizer)
        elif optimizer is not None:
            logger.warning(f"{path} holds no optimizer state for {name}: its optimizer starts fresh")
    try:
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
    except (Exception, CheckpointException) as error:  # a rank's failure (a missing shard, a shape that differs)
        raise CheckpointError(f"cannot resume from {path}: {_first_line(error)} (is it a checkpoint of this "
                              f"model, saved completely?)") from error
    for name, (model, optimizer) in models.items():
        set_model_state_dict(model, state[f"{name}.model"])
        if f"{name}.optimizer" in state:
            set_optimizer_state_dict(model, optimizer, state[f"{name}.optimizer"])
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def load_optimizer_state(path: str, name: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load only `name`'s optimizer state from the checkpoint folder `path` (`actor.optimizer_dir`)."""
    dcp_dir = os.path.join(path, "dcp")
    if not os.path.isdir(dcp_dir):
        raise CheckpointError(f"{name}.optimizer_dir={path}: no dcp/ folder (expected an rl2 checkpoint step folder)")
    if not any(k.startswith(f"{name}.optimizer.") for k in _read_saved_keys(path)):
        raise CheckpointError(f"{name}.optimizer_dir={path} holds no optimizer state for {name} "
                              "(saved with save_optimizer=false?)")
    state = {f"{name}.optimizer": get_optimizer_state_dict(model, optimizer)}
    try:
        dcp.load(state, checkpoint_id=dcp_dir)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"cannot load {name}.optimizer_dir={path}: {_first_line(error)}") from error
    set_optimizer_state_dict(model, optimizer, state[f"{name}.optimizer"])


def _read_saved_keys(path: str) -> list[str]:
    """The state keys a checkpoint folder's `dcp/` metadata lists."""
    try:
        return list(dcp.FileSystemReader(os.path.join(path, "dcp")).read_metadata().state_dict_metadata)
    except (OSError, ValueError, EOFError) as error:
        raise CheckpointError(f"cannot read the checkpoint in {path}: {_first_line(error)}") from error


def _first_line(error: BaseException) -> str:
    """An error's message in one line; for dcp's CheckpointException, the first rank's own error."""
    if isinstance(error, CheckpointException) and error.failures:
        failure = next(iter(error.failures.values()))  # (exception, its stack)
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, OSError) and error.filename is None:
            return f"a file of it cannot be read ({error.strerror or error})"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
