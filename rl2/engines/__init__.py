"""Rollout engines: generate completions with exact log-probs and take weight updates."""

import torch

from rl2.config import ConfigError, ModelConfig, RolloutConfig
from rl2.distributed.process_group import device
from rl2.engines.base import Engine, Generation, SamplingParams, Turn
from rl2.engines.hf import HFEngine

__all__ = ["Engine", "Generation", "HFEngine", "SamplingParams", "Turn", "build_engine", "build_engine_from_config",
           "check_sglang"]


def build_engine(
    name: str, model_path: str, tokenizer, device: torch.device, dtype: str, seed: int, **kwargs
) -> Engine:
    """The rollout engine called `name` ("hf", "sglang" or "vllm"); `kwargs` go to its constructor.

    `device` places the embedded engine; SGLang places its engine from the rank's TP group.
    """
    if name == "hf":
        return HFEngine(model_path, tokenizer, device, dtype=dtype, seed=seed, **kwargs)
    if name == "sglang":
        from rl2.engines.sglang import SGLangEngine  # imports sglang only when chosen

        return SGLangEngine(model_path, tokenizer, dtype=dtype, seed=seed, **kwargs)
    if name == "vllm":
        from rl2.engines.vllm import VLLMEngine  # imports vllm only when chosen

        return VLLMEngine(model_path, tokenizer, device, dtype=dtype, seed=seed, **kwargs)
    raise ValueError(f"unknown rollout engine {name!r}; choose 'hf', 'sglang' or 'vllm'")


def build_engine_from_config(rollout: RolloutConfig, policy: ModelConfig, tokenizer, seed: int) -> Engine:
    """The `rollout.engine` serving `policy.model_name` on this rank in `rollout.dtype` (else the policy's),
    with the rollout section's options; under actor.router_replay=r3 the engine records routes."""
    record_routes = getattr(policy, "router_replay", "off") == "r3"
    options = {"max_batch_size": rollout.max_batch_size, "cuda_graphs": rollout.cuda_graphs,
               "attn_implementation": rollout.attn_implementation, "record_routes": record_routes}
    if rollout.engine == "sglang":
        options = {"tp_size": rollout.tp_size, "memory_fraction": rollout.gpu_memory_utilization,
                   "bucket_mb": rollout.sync_bucket_mb, "server_args": dict(rollout.server_args),
                   "image_embedding_cache": policy.freeze_vision, "record_routes": record_routes}
    if rollout.engine == "vllm":
        options = {"tp_size": rollout.tp_size, "gpu_memory_utilization": rollout.gpu_memory_utilization,
                   "max_batch_size": rollout.max_batch_size, "record_routes": record_routes}
    dtype = rollout.dtype or policy.dtype
    return build_engine(rollout.engine, policy.model_name, tokenizer, device(), dtype, seed=seed, **options)


def check_sglang(tp_size: int) -> None:
    """SGLang is installed and `tp_size` fits the world and the nodes (a ConfigError if not)."""
    from rl2.engines.sglang import load_sglang
    from rl2.engines.tp_group import plan_this_rank

    try:
        load_sglang()
        plan_this_rank(tp_size)
    except (ImportError, ValueError) as error:
        raise ConfigError(str(error)) from error
