"""mRoPE positions of vision-language samples and their packing into one padding-free row.

Qwen2.5-VL and Qwen3-VL rotate text tokens by their index and image tokens by (temporal, height, width)
grid coordinates; text after an image continues from the image's largest coordinate. The three rows are
computed per sample by the model's own `get_rope_index`, so each packed sample is positioned as if alone.
"""

from collections.abc import Callable

import torch
from transformers.models.auto.modeling_auto import MODEL_MAPPING

from rl2.distributed.packing import pack_micro_batch

# Keys of a vision sample that are not per-token: concatenated along their first dimension when packing.
IMAGE_KEYS = ("pixel_values", "image_grid_thw")
VISION_POSITIONS = "vision_position_ids"


def rope_index_from_config(config) -> Callable:
    """The `get_rope_index` of a model of `config` (a Qwen-VL config), without its weights: the model is
    built on the meta device (only the config is read), so data workers can position samples."""
    with torch.device("meta"):
        inner = MODEL_MAPPING[type(config)](config)
    return rope_index_of(inner)


def rope_index_of(model: torch.nn.Module) -> Callable:
    """The model's `get_rope_index` (on a `...ForConditionalGeneration` or its inner `...Model`)."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "get_rope_index"):
        raise ValueError(f"{type(model).__name__} has no get_rope_index: not a Qwen-VL model")
    return inner.get_rope_index


def mrope_position_ids(rope_index: Callable, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    """A sample's (temporal, height, width) positions [3, L], from `input_ids`, `mm_token_type_ids` and
    `image_grid_thw` (absent: a text-only sample)."""
    positions, _ = rope_index(
        sample["input_ids"].unsqueeze(0),
        mm_token_type_ids=sample["mm_token_type_ids"].unsqueeze(0),
        image_grid_thw=sample.get("image_grid_thw"),
    )
    return positions[:, 0]


def pack_vision_samples(samples: list[dict[str, torch.Tensor]], rope_index: Callable) -> dict[str, torch.Tensor]:
    """Samples (`rl2.vision.inputs.build_vision_sample`'s, in order) as one packed row.

    Per-token keys become [1, T] with `position_ids` [1, T] (restarting at 0 per sample) and `cu_seqlens`
    [n + 1] as `pack_micro_batch` makes them; `vision_position_ids` [3, 1, T] holds each sample's own mRoPE
    rows (taken from the sample where present, else computed); `pixel_values` and `image_grid_thw` are the
    samples' concatenated in order, absent when no sample has an image."""
    per_token = []
    for sample in samples:
        per_token.append({k: v for k, v in sample.items() if k not in IMAGE_KEYS and k != VISION_POSITIONS})
    row = pack_micro_batch(per_token)
    rows = [sample[VISION_POSITIONS] if VISION_POSITIONS in sample else mrope_position_ids(rope_index, sample)
            for sample in samples]
    row[VISION_POSITIONS] = torch.cat(rows, dim=1).unsqueeze(1).to(row["input_ids"].device)
    for key in IMAGE_KEYS:
        parts = [sample[key] for sample in samples if key in sample]
        if parts:
            row[key] = torch.cat(parts)
    return row
