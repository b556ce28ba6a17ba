"""The stock transformers Qwen-VL model over one packed row: the vision tower over all the row's images
(bidirectional attention within each image), the text model with varlen causal attention within each
sample and each sample's own mRoPE positions.
"""

import torch

from rl2.kernels.attention import packed_attention_implementation
from rl2.vision.positions import VISION_POSITIONS

# Vision-tower attention that is bidirectional within each image whatever text-model arguments it is passed.
BIDIRECTIONAL = ("sdpa", "eager")


def vision_attention_implementation(device: torch.device, requested: str = "auto",
                                    dtype: torch.dtype | None = None) -> dict[str, str]:
    """`attn_implementation` for loading a Qwen-VL model to train on packed rows: rl2's packed-row attention
    for the text model, sdpa for the vision tower (whose attention must stay bidirectional; rl2's kernels
    are causal). transformers (5.24) has no flex attention for the Qwen-VL text models: a ValueError."""
    text = packed_attention_implementation(device, requested, dtype)
    if text == "flex_attention":
        raise ValueError("attn_implementation=flex_attention: transformers has no flex attention for Qwen-VL "
                         "models; use sdpa_loop, torch_varlen or flash_attention_2")
    return {"text_config": text, "vision_config": "sdpa"}


def packed_vision_inputs(row: dict[str, torch.Tensor]) -> dict:
    """The keyword arguments of `model(**inputs)` for a packed row (`rl2.vision.positions.pack_vision_samples`):
    4-row position ids (text positions, then the mRoPE rows), the sequence bounds for varlen attention,
    and the row's images."""
    cu_seqlens = row["cu_seqlens"]
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    inputs = {
        "input_ids": row["input_ids"],
        "position_ids": torch.cat([row["position_ids"].unsqueeze(0), row[VISION_POSITIONS]]),
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": longest,
        "max_length_k": longest,
        "use_cache": False,
    }
    if "pixel_values" in row:
        inputs["pixel_values"] = row["pixel_values"]
        inputs["image_grid_thw"] = row["image_grid_thw"]
    return inputs


def packed_vision_forward(model: torch.nn.Module, row: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits [1, T, vocab] over a packed row.

    The images go through the model's own forward (under FSDP the vision tower's unsharded parameters
    exist only there), which passes the text model's attention arguments (`cu_seq_lens_q`, ...) to the
    vision tower too: its attention must be one that ignores them (sdpa, eager), else a ValueError."""
    vision = model.config.vision_config._attn_implementation
    if "pixel_values" in row and vision not in BIDIRECTIONAL:
        raise ValueError(f"the vision tower's attention is {vision!r}: packed rows need one of {BIDIRECTIONAL} "
                         f"(load the model with attn_implementation=vision_attention_implementation(...))")
    return model(**packed_vision_inputs(row)).logits
