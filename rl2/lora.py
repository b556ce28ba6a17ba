"""LoRA adapters on a worker's model (peft): added before the model is sharded, so that only the
adapters train (their gradients and optimizer state are all that a step keeps); the reference policy
as the same model with its adapters disabled; the merged weights W + B A · alpha / r for the engine
and for export; the adapter saved in peft's format."""

import contextlib
import dataclasses
import os
from collections.abc import Iterator

import torch
from torch import nn

from rl2.config import LoraConfig

# peft `exclude_modules` (a regex over full module names) for a vision-language model's vision tower
# (Qwen-VL's `model.visual`) and everything in it: `target_modules="all-linear"` alone adapts the tower too.
VISION_TOWER_MODULES = r".*\.visual(\..*)?"


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is a peft model with LoRA adapters."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def add_lora(model: nn.Module, settings: LoraConfig, modules_to_save: list[str] | None = None) -> nn.Module:
    """`model` as a peft model with LoRA adapters of `settings` on its target layers (frozen base
    weights); `modules_to_save` (a head that must train whole, e.g. a critic's `score`) stay trainable.
    The adapters' initial A is drawn from a fixed seed, B is zero: the model starts as the base."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = settings.target_modules.strip()
    # A vision-language model's vision tower gets no adapters (it is frozen by default: `actor.freeze_vision`).
    exclude = {"exclude_modules": VISION_TOWER_MODULES} if _has_vision_tower(model) else {}
    config = PeftLoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
        modules_to_save=modules_to_save, **exclude,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return get_peft_model(model, config)


def _has_vision_tower(model: nn.Module) -> bool:
    return getattr(getattr(model, "model", None), "visual", None) is not None


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft model (the model itself otherwise)."""
    return model.get_base_model() if is_lora(model) else model


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """A context in which `model` computes as its base model (no-op without adapters). It sets peft's own
    per-layer flag: peft's `disable_adapter()` also switches the adapters' requires_grad off and on, and
    FSDP2, initialised lazily at the first forward, must not see its parameters' requires_grad change
    (with frozen bf16 weights beside fp32 adapters it then reduces gradients in the wrong dtype)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


class AdaptersOff:
    """The reference policy of a LoRA policy: the same model with its adapters disabled, so no second
    copy of the weights exists (as TRL and verl do). Has the reference's `compute`."""

    def __init__(self, policy):
        self.policy = policy

    def compute(self, sequences: list[dict[str, torch.Tensor]], output: str = "logps") -> list[torch.Tensor]:
        with adapters_disabled(self.policy.model):
            return self.policy.compute(sequences, output)


@dataclasses.dataclass(frozen=True)
class Adapted:
    """A weight that a LoRA adapter changes: the adapter's layer (`prefix`, for `adapter_keys`), its scaling
    alpha / r, and, for a mixture-of-experts block's stacked experts weight that peft adapts per expert
    (its `ParamWrapper`, `target_parameters`), the number of experts and whether the weight is
    [experts, out, in] (else [experts, in, out])."""

    prefix: str
    scaling: float
    experts: int = 1
    out_first: bool = False


def adapted_weights(model: nn.Module) -> dict[str, Adapted]:
    """State-dict key of each weight an active LoRA adapter changes → how (`Adapted`). A linear layer's is
    `<layer>.base_layer.weight`; peft's adapters on an MoE block's parameters (a router's weight, the stacked
    experts' `gate_up_proj` and `down_proj` under `target_modules=all-linear`) nest, one wrapper per
    parameter, so the parameter sits under one `.base_layer` per wrapper."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapter = module.active_adapters[0]
        if adapter not in module.lora_A:
            continue
        if isinstance(module, ParamWrapper):
            key, inner = name, module
            while isinstance(inner, BaseTunerLayer):
                key, inner = f"{key}.base_layer", inner.base_layer
            adapted[f"{key}.{module.parameter_name}"] = Adapted(name, float(module.scaling[adapter]), module.num_experts,
                                                                bool(module._did_swap_in_out_features))
        else:
            adapted[f"{name}.base_layer.weight"] = Adapted(name, float(module.scaling[adapter]))
    return adapted


def adapter_keys(prefix: str, adapter: str = "default") -> tuple[str, str]:
    """The state-dict keys of a LoRA layer's A and B."""
    return f"{prefix}.lora_A.{adapter}.weight", f"{prefix}.lora_B.{adapter}.weight"


def merge(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, how: Adapted) -> torch.Tensor:
    """W + B A · scaling, computed in fp32, in `weight`'s dtype; per expert for stacked experts (as peft's
    `ParamWrapper.get_delta_weight`: A holds each expert's rank rows in turn, B each rank's experts)."""
    lora_a, lora_b = lora_a.float(), lora_b.float()
    if how.experts == 1:
        delta = lora_b @ lora_a
    else:
        lora_a = lora_a.reshape(how.experts, -1, lora_a.shape[-1])  # [experts, rank, in]
        lora_b = lora_b.reshape(lora_b.shape[0], -1, how.experts)  # [out, rank, experts]
        delta = torch.einsum("ore,eri->eoi" if how.out_first else "ore,eri->eio", lora_b, lora_a)
    return (weight.float() + delta * how.scaling).to(weight.dtype)


def base_key(key: str) -> str:
    """A peft model's state-dict key → the base model's (the LoRA wrappers' `.base_layer`s, nested or not,
    and a saved module's copy dropped)."""
    key = key.replace(".modules_to_save.default.", ".")
    while ".base_layer." in key:
        key = key.replace(".base_layer.", ".")
    return key.removeprefix("base_model.model.")


def merged_state_dict(state_dict: dict[str, torch.Tensor], adapted: dict[str, Adapted]) -> dict[str, torch.Tensor]:
    """A peft model's full state dict → the base model's, with every adapted weight (`adapted_weights`) merged
    (keys as `save_pretrained` of the base model writes them)."""
    merged = {}
    for key, tensor in state_dict.items():
        if ".lora_" in key or ".original_module." in key:
            continue
        if key in adapted:
            a, b = adapter_keys(adapted[key].prefix)
            tensor = merge(tensor, state_dict[a], state_dict[b], adapted[key])
        merged[base_key(key)] = tensor
    return merged


def save_adapter(model: nn.Module, state_dict: dict[str, torch.Tensor], path: str) -> None:
    """Write the adapter of `model` (its full `state_dict`, gathered) in peft's format:
    `PeftModel.from_pretrained(base, path)` loads it."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    adapter = get_peft_model_state_dict(model, state_dict=state_dict)
    save_file({key: tensor.contiguous() for key, tensor in adapter.items()}, os.path.join(path, "adapter_model.safetensors"))
    config = model.peft_config["default"]
    config.base_model_name_or_path = config.base_model_name_or_path or base_model(model).config.name_or_path
    config.save_pretrained(path)
