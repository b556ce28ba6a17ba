"""Causal attention with attention sinks and a sliding window, as transformers computes it for gpt-oss.

An attention sink is a learned logit per head that joins every query's softmax denominator and
contributes no value (a key of zero value whose score is the sink): a query may attend to nothing.
A sliding window of W keeps the W most recent keys of each query, itself included. This is the
arithmetic of transformers' `eager_attention_forward` for gpt-oss, for sequences of one length at a
time: rl2's packed-row attention calls it per sequence (or per batch of equal-length sequences).
"""

import torch
import torch.nn.functional as F

# Model types whose attention layers have sinks, which flash-attn 2's and torch's varlen kernels lack.
SINK_MODEL_TYPES = ("gpt_oss",)


def sink_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None = None,
    sinks: torch.Tensor | None = None,
    sliding_window: int | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """query [B, heads, Lq, dim], key/value [B, kv_heads, Lk, dim] → [B, heads, Lq, dim]: the queries are
    the last Lq of the Lk positions, each attends causally to the keys within `sliding_window` (None: all),
    with `sinks` [heads] (None: none) in its softmax."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)  # transformers' repeat_kv
    q_positions = torch.arange(key.shape[2] - query.shape[2], key.shape[2], device=query.device)[:, None]
    k_positions = torch.arange(key.shape[2], device=query.device)[None, :]
    visible = k_positions <= q_positions
    if sliding_window is not None:
        visible = visible & (k_positions > q_positions - sliding_window)
    head_sinks = None if sinks is None else sinks.reshape(1, -1, 1, 1)
    return masked_sink_attention(query, key, value, visible, scaling, head_sinks, dropout)


def masked_sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    scaling: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """query [B, H, Lq, dim], key/value [B, H, Lk, dim] → [B, H, Lq, dim], each query attending to the keys
    `visible` (bool, broadcast to [B, H, Lq, Lk]) with `sinks` (broadcast to [B, H, Lq, 1]; None: none) in its
    softmax."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    if sinks is None:
        probs = F.softmax(scores, dim=-1)
    else:
        combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values  # as transformers does (half precision)
        probs = F.softmax(combined, dim=-1)[..., :-1]  # the sink's share goes nowhere
    probs = F.dropout(probs, p=dropout).to(value.dtype)
    return torch.matmul(probs, value)
