"""Checkpoints: a Hugging Face model folder for users, plus sharded state for an exact resume.

Layout of `<save_dir>/step<N>/`:
- `config.json`, `model.safetensors`, tokenizer files: the actor, loadable with `from_pretrained`
  (other models, e.g. a critic, in sub-folders named after them);
- `dcp/`: model (fp32 master weights) and optimizer shards, written with torch.distributed.checkpoint;
- `trainer_state.json`: step, data position, schedulers. Written last: its presence marks the
  checkpoint complete, so a run killed mid-save never resumes from a half-written one.
"""

import json
import logging
import os
import re

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from rl2.distributed.fsdp import DTYPES, gather_full_state_dict
from rl2.distributed.process_group import barrier, is_rank0

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


def checkpoint_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step{step}")


def find_latest_checkpoint(save_dir: str) -> str | None:
    """The complete checkpoint with the highest step under `save_dir`, or None."""
    if not os.path.isdir(save_dir):
        return None
    steps = [
        int(match.group(1))
        for name in os.listdir(save_dir)
        if (match := re.fullmatch(r"step(\d+)", name)) and os.path.exists(os.path.join(save_dir, name, STATE_FILE))
    ]
    return checkpoint_dir(save_dir, max(steps)) if steps else None


def resolve_checkpoint(load_ckpt_from: str | None, save_dir: str) -> str | None:
    """`trainer.load_ckpt_from`: None (fresh start), `latest` (None if there is none yet) or a folder."""
    if load_ckpt_from is None:
        return None
    if load_ckpt_from == "latest":
        return find_latest_checkpoint(save_dir)
    if not os.path.exists(os.path.join(load_ckpt_from, STATE_FILE)):
        raise FileNotFoundError(f"trainer.load_ckpt_from={load_ckpt_from}: no complete checkpoint there ({STATE_FILE} missing)")
    return load_ckpt_from


def save_hf_model(model: nn.Module, path: str, dtype: str, tokenizer=None) -> None:
    """Gather the full weights on rank 0 and write a `from_pretrained`-loadable folder (all ranks call this)."""
    state_dict = gather_full_state_dict(model)
    if is_rank0():
        torch_dtype = DTYPES[dtype]
        model.config.dtype = torch_dtype
        model.save_pretrained(path, state_dict={k: v.to(torch_dtype) for k, v in state_dict.items()})
        if tokenizer is not None:
            tokenizer.save_pretrained(path)


def save_checkpoint(
    path: str,
    models: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]],
    trainer_state: dict,
) -> None:
    """Write the sharded state of `models` ({name: (model, optimizer or None)}) and `trainer_state`."""
    state = {}
    for name, (model, optimizer) in models.items():
        state[f"{name}.model"] = get_model_state_dict(model)
        if optimizer is not None:
            state[f"{name}.optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=os.path.join(path, "dcp"))
    barrier()
    if is_rank0():
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump(trainer_state, f, indent=1)
    barrier()
    logger.info(f"checkpoint saved to {path}")


def load_checkpoint(path: str, models: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]]) -> dict:
    """Restore `models` in place from `path` and return its trainer state.

    An optimizer whose state was not saved (`save_optimizer=false`) starts fresh, with a warning.
    """
    saved_keys = set(dcp.FileSystemReader(os.path.join(path, "dcp")).read_metadata().state_dict_metadata)
    state = {}
    for name, (model, optimizer) in models.items():
        state[f"{name}.model"] = get_model_state_dict(model)
        if optimizer is not None and any(k.startswith(f"{name}.optimizer.") for k in saved_keys):
            state[f"{name}.optimizer"] = get_optimizer_state_dict(model, optimizer)
        elif optimizer is not None:
            logger.warning(f"{path} holds no optimizer state for {name}: its optimizer starts fresh")
    dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
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
        raise FileNotFoundError(f"optimizer_dir={path}: no dcp/ folder (expected an rl2 checkpoint step folder)")
    saved_keys = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    if not any(k.startswith(f"{name}.optimizer.") for k in saved_keys):
        raise ValueError(f"optimizer_dir={path} holds no optimizer state for {name} (saved with save_optimizer=false?)")
    state = {f"{name}.optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=dcp_dir)
    set_optimizer_state_dict(model, optimizer, state[f"{name}.optimizer"])
