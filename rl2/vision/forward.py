"""The stock transformers Qwen-VL model over one packed row: the vision tower once over all the row's
images (bidirectional attention within each image), the text model with varlen causal attention within
each sample and each sample's own mRoPE positions.
"""

import torch

from rl2.kernels.attention import packed_attention_implementation
from rl2.vision.positions import VISION_POSITIONS


def vision_attention_implementation(device: torch.device, requested: str = "auto",
                                    dtype: torch.dtype | None = None) -> dict[str, str]:
    """`attn_implementation` for loading a Qwen-VL model to train on packed rows: rl2's packed-row attention
    for the text model, sdpa for the vision tower (whose attention must stay bidirectional; rl2's kernels
    are causal)."""
    return {"text_config": packed_attention_implementation(device, requested, dtype), "vision_config": "sdpa"}


def dummy_image(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """`pixel_values` and `image_grid_thw` of the smallest image the vision tower takes (one merged patch)."""
    config = model.config.vision_config
    merge, patch = config.spatial_merge_size, config.patch_size
    dim = config.in_channels * config.temporal_patch_size * patch * patch
    device = next(model.parameters()).device
    return torch.zeros(merge * merge, dim, device=device), torch.tensor([[1, merge, merge]], device=device)


def packed_vision_inputs(model: torch.nn.Module, row: dict[str, torch.Tensor]) -> dict:
    """The keyword arguments of `model(**inputs)` for a packed row (`rl2.vision.positions.pack_vision_samples`):
    4-row position ids (text positions, then the mRoPE rows), the sequence bounds for varlen attention, and
    the vision tower's outputs.

    The vision tower runs here, not inside the model's forward: there it is passed the text model's
    attention arguments too (`cu_seq_lens_q`, ...), which sdpa ignores but a flash-attention vision tower
    would take for the images' own bounds."""
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
        inner = getattr(model, "model", model)
        inputs["mm_encoder_outputs"] = {
            "image": inner.get_image_features(row["pixel_values"], row["image_grid_thw"], return_dict=True)}
    return inputs


def packed_vision_forward(model: torch.nn.Module, row: dict[str, torch.Tensor],
                          dummy_vision: bool = False) -> torch.Tensor:
    """The model's logits [1, T, vocab] over a packed row.

    With `dummy_vision`, a row without images still runs the vision tower (on a one-patch blank image, its
    outputs times 0 added to the logits), so every parameter takes part in every step: FSDP ranks whose
    rows have no image join the vision tower's collectives as the others do."""
    inputs = packed_vision_inputs(model, row)
    logits = model(**inputs).logits
    if dummy_vision and "pixel_values" not in row:
        inner = getattr(model, "model", model)
        out = inner.get_image_features(*dummy_image(model), return_dict=True)
        deepstack = getattr(out, "deepstack_features", None) or []  # Qwen3-VL's, one tuple per level
        features = [*out.pooler_output, *(f for level in deepstack for f in level)]
        logits = logits + 0.0 * sum(f.sum() for f in features)
    return logits
