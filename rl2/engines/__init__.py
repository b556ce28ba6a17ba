"""Rollout engines: generate completions with exact log-probs and take weight updates."""

import torch

from rl2.engines.base import Engine, Generation, SamplingParams, Turn
from rl2.engines.hf import HFEngine

__all__ = ["Engine", "Generation", "HFEngine", "SamplingParams", "Turn", "build_engine"]


def build_engine(
    name: str, model_path: str, tokenizer, device: torch.device, dtype: str, seed: int, **kwargs
) -> Engine:
    """The rollout engine called `name` ("hf" or "sglang"); `kwargs` go to its constructor.

    `device` places the embedded engine; SGLang places its engine from the rank's TP group.
    """
    if name == "hf":
        return HFEngine(model_path, tokenizer, device, dtype=dtype, seed=seed, **kwargs)
    if name == "sglang":
        from rl2.engines.sglang import SGLangEngine  # imports sglang only when chosen

        return SGLangEngine(model_path, tokenizer, dtype=dtype, seed=seed, **kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose 'hf' or 'sglang'")
