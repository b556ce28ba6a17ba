"""The names and buckets an inference engine loads pushed weights under: our state-dict names mapped to the
Hugging Face checkpoint's (`engine_param_name`), and tensors grouped into buckets of one dtype (`bucketed`).
Every engine adapter (hf, sglang, vllm) and the split placement's push use them."""

from collections.abc import Iterable, Iterator

import torch


# Module names that wrappers insert into parameter names: FSDP1 / checkpoint wrappers, torch.compile.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
_PEFT_PREFIX = "base_model.model."
_TIED_HEAD = "lm_head.weight"


def engine_param_name(name: str, tied_embeddings: bool) -> str | None:
    """The Hugging Face checkpoint name an inference engine loads for our state-dict `name`, or
    None for a tensor it must not get (the output head of a model with tied embeddings: the
    engine ties it to `model.embed_tokens.weight`, which is sent).

    Strips wrapper prefixes (FSDP1, activation checkpointing, torch.compile, DDP's `module.`) and
    PEFT's `base_model.model.` / `.base_layer`. Unmerged LoRA weights are an error: an engine
    loading base weights would drop them, so merge adapters before syncing.
    """
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    if name.startswith("module."):
        name = name[len("module.") :]
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    if ".modules_to_save." in name or ".original_module." in name:
        raise ValueError(
            f"weight sync: {name!r} belongs to a PEFT modules_to_save copy; merge the adapters into the base "
            f"weights (peft's merge_and_unload) before syncing them to the engine"
        )
    if ".lora_" in name:
        raise ValueError(
            f"weight sync: {name!r} is an unmerged LoRA adapter weight; merge the adapters into the base "
            f"weights (peft's merge_and_unload) before syncing them to the engine"
        )
    while ".base_layer." in name:  # nested: peft's wrappers of an MoE block's parameters, one per parameter
        name = name.replace(".base_layer.", ".")
    if tied_embeddings and name == _TIED_HEAD:
        return None
    return name


def engine_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], tied_embeddings: bool, stored_names: dict[str, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_tensors` under the names an inference engine loads (see `engine_param_name`), then under the
    checkpoint's own names where `stored_names` (`checkpoint_names`) has them."""
    for name, tensor in named_tensors:
        mapped = engine_param_name(name, tied_embeddings)
        if mapped is not None:
            yield (stored_names or {}).get(mapped, mapped), tensor


def checkpoint_names(model_path: str) -> dict[str, str]:
    """A vision-language model's parameter names as transformers holds them -> as its checkpoint stores them,
    where they differ (Qwen2.5-VL: `model.visual.*` is stored as `visual.*`, `model.language_model.*` as
    `model.*`; Qwen3-VL: none differ). An engine that loads pushes by checkpoint name (SGLang's `load_weights`
    skips names it does not know, silently) needs the stored ones. The names are what `save_pretrained` writes
    (transformers' `revert_weight_conversion`), found on the model built on the meta device."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_path))
    names = {}
    for name, tensor in model.state_dict().items():
        stored = list(revert_weight_conversion(model, {name: tensor}))
        if len(stored) == 1 and stored[0] != name:
            names[name] = stored[0]
    return names


def bucketed(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of `named_tensors` of one dtype and about `bucket_bytes` each.

    A bucket closes when the next tensor has another dtype or would push it past `bucket_bytes`;
    a tensor larger than `bucket_bytes` is a bucket of its own. Order is kept.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (tensor.dtype != bucket[0][1].dtype or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
