"""FSDP2 models: meta-device init, weights loaded once and broadcast, full state dicts, offloading."""

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from rl2.config import LoraConfig
from rl2.distributed.process_group import is_rank0
from rl2.kernels.attention import packed_attention_implementation
from rl2.kernels.logps_head import install_logps_head
from rl2.lora import add_lora, base_model
from rl2.models.linear_attention import install_packed_linear_attention

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_fsdp_model(
    model_name: str,
    mesh: DeviceMesh,
    device: torch.device,
    dtype: str = "bfloat16",
    gradient_checkpointing: bool = False,
    model_cls: type = AutoModelForCausalLM,
    attn_implementation: str | None = None,
    attention: str = "auto",
    logps_chunk_size: int = 0,
    compile_layers: bool = False,
    prepare: Callable[[nn.Module], None] | None = None,
    lora: LoraConfig | None = None,
    lora_modules_to_save: list[str] | None = None,
    **config_overrides,
) -> nn.Module:
    """A transformers model sharded with `fully_shard` per decoder layer and at the root.

    Master weights are fp32 shards; forward and backward run in `dtype`; gradients are reduced
    in fp32. Rank 0 reads the checkpoint once and broadcasts it; the other ranks never hold a
    full copy. `attn_implementation` names a registered attention function (ring attention);
    otherwise `attention` picks one for packed rows (`rl2.kernels.attention.choose_attention`). `config_overrides` go to the model config (e.g. `num_labels=1` for a critic). With
    `logps_chunk_size` > 0 a causal LM's `lm_head` becomes a `TokenLogpsHead` (log-probs in chunks of
    that many tokens, see `rl2.kernels.logps_head`) where the model allows it. `compile_layers` compiles each
    decoder layer (after checkpointing wraps it, before sharding, as torchtitan does) and the log-prob
    head's softmax work. `prepare` runs on
    the model while it is still on the meta device, before any of that (e.g. to replace a head).
    With `lora` (rank > 0) the model becomes a peft model with LoRA adapters (`rl2.lora`) before it is
    sharded: its base weights frozen and stored in `dtype`, `lora_modules_to_save` trained whole.
    """
    config = AutoConfig.from_pretrained(model_name)
    for key, value in config_overrides.items():
        setattr(config, key, value)  # from_pretrained(**kwargs) drops keys the config class does not declare
    use_lora = lora is not None and lora.rank > 0
    full_state_dict = {}
    if is_rank0():
        full_model = model_cls.from_pretrained(model_name, config=config, dtype=torch.float32)
        if use_lora:  # the adapters' names and initial values, as the sharded model will have them
            if prepare is not None:
                prepare(full_model)
            full_model = add_lora(full_model, lora, lora_modules_to_save)
        full_state_dict = full_model.state_dict()
        del full_model
    with torch.device("meta"):
        model = model_cls.from_config(
            config,
            dtype=torch.float32,
            attn_implementation=attn_implementation
            or packed_attention_implementation(device, attention, DTYPES[dtype], config.model_type),
        )
    if prepare is not None:
        prepare(model)
    if use_lora:
        model = add_lora(model, lora, lora_modules_to_save)
        # The frozen base weights are kept in the compute dtype (no fp32 master copy: they never update);
        # the adapters keep fp32 masters. FSDP2 gathers both as `dtype`.
        for parameter in model.parameters():
            if not parameter.requires_grad:
                parameter.data = parameter.data.to(DTYPES[dtype])
    if install_packed_linear_attention(model, device) is not None:  # a hybrid model: its recurrences per sequence
        logger.info(f"{type(model).__name__}: linear-attention layers run per sequence in packed rows")
    if logps_chunk_size > 0:
        if install_logps_head(base_model(model), logps_chunk_size, fused=compile_layers) is None:
            logger.info(f"{type(model).__name__}: log-probs from full logits (its head is not a plain linear layer)")
    if gradient_checkpointing:
        enable_activation_checkpointing(base_model(model))

    mp_policy = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (no _no_split_modules)")
    for block in blocks:
        if compile_layers:
            block.compile()  # in place: the module, its names and its hooks stay
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)

    model.to_empty(device=device)
    # broadcast_from_rank0 consumes the dict it is given: nothing else reads full_state_dict after.
    set_model_state_dict(
        model, full_state_dict, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    _recompute_rotary_buffers(model, device)
    model.config.use_cache = False
    return model


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Checkpoint each decoder layer (non-reentrant). transformers >= 5.2x names it
    `activation_checkpointing_enable` (and deprecates `gradient_checkpointing_enable`); 5.12.1, which
    SGLang 0.5.20/0.5.21 pin, has only `gradient_checkpointing_enable`."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _recompute_rotary_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (RoPE `inv_freq`) are garbage after `to_empty`: rebuild them."""
    for module in model.modules():
        buffers = dict(module.named_buffers(recurse=False))
        if "inv_freq" not in buffers:
            continue
        fresh = type(module)(module.config)
        for name, buffer in fresh.named_buffers(recurse=False):
            buffers[name].copy_(buffer.to(device))


@contextlib.contextmanager
def gathered_while_accumulating(model: nn.Module, enabled: bool) -> Iterator[Callable[[bool], None]]:
    """Gradient accumulation with every layer's parameters gathered once and its gradient reduced once.

    Yields `before_micro_batch(last)`, to call before each micro-batch's forward. Where `enabled` (meant for
    a one-rank mesh, where sharding saves no memory), the layers stay gathered from their first forward
    until the last micro-batch's backward, and the gradients are kept unsharded (FSDP2 accumulates them in
    its reduce dtype, fp32) and reduced after the last micro-batch. Otherwise each layer is gathered in
    forward, again in backward, and its gradient reduced, per micro-batch: on an H200 at 0.5B that was
    thousands of copies and casts a step. On one rank the two give the same gradients bit for bit; on
    more, keeping every gradient unsharded would cost each rank a full fp32 copy of the model.
    """
    if not enabled or not isinstance(model, FSDPModule):
        yield lambda last: None
        return

    def before_micro_batch(last: bool) -> None:
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)

    # The layers only: the root keeps its own setting (FSDP2 leaves it gathered after forward already).
    layers = [module for module in model.modules() if isinstance(module, FSDPModule) and module is not model]
    for layer in layers:
        layer.set_reshard_after_forward(False, recurse=False)
    try:
        yield before_micro_batch
    finally:
        for layer in layers:
            layer.set_reshard_after_forward(True, recurse=False)
        model.set_reshard_after_backward(True)
        model.set_requires_gradient_sync(True)


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded fp32 state dict on CPU, on rank 0 only (empty on the other ranks)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move the optimizer's state tensors (offloading to CPU, or back). Adam's `step` counts stay on
    the CPU unless the group is fused or capturable: foreach Adam reads a device `step` with one
    `.item()` (a host sync) per parameter tensor."""
    for group in optimizer.param_groups:
        step_on_device = bool(group.get("fused") or group.get("capturable"))
        for parameter in group["params"]:
            state = optimizer.state.get(parameter, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and (key != "step" or step_on_device):
                    state[key] = value.to(device, non_blocking=True)
