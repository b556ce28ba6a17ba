"""Variable-length causal attention for packed rows, plugged into transformers' attention registry.

transformers' sdpa path handles a packed row by building a block-diagonal T×T mask from
`position_ids` and computing attention over the whole row: packing then costs (Σ L)² instead of
Σ L². `varlen_attention` runs causal attention within each sequence instead. On CUDA with
flash-attn installed, transformers' own `flash_attention_2` (varlen kernel, boundaries from
`position_ids`) is used instead.
"""

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

VARLEN_ATTENTION = "rl2_varlen"


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence lengths [n+1] of a packed row whose positions restart at 0 per sequence."""
    positions = position_ids.reshape(-1)
    starts = torch.nonzero(positions == 0).reshape(-1)
    if starts.numel() == 0 or starts[0] != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention restricted to each sequence of a packed row.

    query [1, heads, T, dim], key/value [1, kv_heads, T, dim] → output [1, T, heads, dim]. The
    boundaries come from `cu_seq_lens_q` if given, else from `position_ids`, else the row is one
    sequence.
    """
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN_ATTENTION} attention takes packed rows of batch size 1, got {query.shape[0]}")
    if cu_seq_lens_q is None:
        cu_seq_lens_q = (
            cu_seqlens_from_position_ids(position_ids)
            if position_ids is not None
            else torch.tensor([0, query.shape[2]], dtype=torch.int32)
        )
    bounds = cu_seq_lens_q.tolist()
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=True,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def no_dense_mask(*args, **kwargs) -> None:
    """Mask function for attention that takes boundaries from the sequence lengths: no dense mask."""
    return None


def packed_attention_implementation(device: torch.device) -> str:
    """The attention implementation for packed training rows on `device`, registering ours if needed."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    AttentionMaskInterface.register(VARLEN_ATTENTION, no_dense_mask)
    return VARLEN_ATTENTION
