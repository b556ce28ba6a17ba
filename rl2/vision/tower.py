"""The vision tower of a Qwen-VL model: finding it, freezing it, keeping LoRA adapters off it."""

from torch import nn

from rl2.lora import VISION_TOWER_MODULES, base_model  # noqa: F401 (the tower's LoRA exclusion, re-exported)
# The tower's projectors into the text model's width: Qwen2.5-VL's `merger`, Qwen3-VL's also `deepstack_merger_list`.
MERGERS = ("merger", "deepstack_merger_list")


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision tower (`model.model.visual`) of a Qwen-VL model, or of a peft model around one."""
    inner = getattr(base_model(model), "model", None)
    tower = getattr(inner, "visual", None)
    if tower is None:
        raise ValueError(f"{type(base_model(model)).__name__} has no vision tower (model.visual)")
    return tower


def freeze_vision_tower(model: nn.Module, keep_mergers: bool = False) -> list[str]:
    """Stop the vision tower's parameters from training (`requires_grad=False`); with `keep_mergers` its
    projectors into the text model (`MERGERS`) still train. Returns the frozen parameters' names."""
    frozen = []
    for name, parameter in vision_tower(model).named_parameters():
        if keep_mergers and name.split(".")[0] in MERGERS:
            continue
        parameter.requires_grad_(False)
        frozen.append(name)
    return frozen
