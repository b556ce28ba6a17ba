"""Whether a model reads images: a vision-language model's config has a `vision_config`."""

from transformers import AutoConfig, PretrainedConfig


def is_vision_config(config: PretrainedConfig) -> bool:
    """Whether a model of `config` is a vision-language model (Qwen2.5-VL, Qwen3-VL, ...)."""
    return getattr(config, "vision_config", None) is not None


def is_vision_model(model_name: str | None) -> bool:
    """Whether the model `model_name` (a hub name or folder) is a vision-language model; False when its
    config cannot be read (loading the model then fails with its own error)."""
    if model_name is None:
        return False
    try:
        return is_vision_config(AutoConfig.from_pretrained(model_name))
    except (OSError, ValueError):
        return False
