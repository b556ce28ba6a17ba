"""A KV cache of fixed slots, one sequence per slot, and the attention that writes and reads it.

The `hf` engine keeps each sequence it generates in a slot of preallocated key/value tensors
([slots, kv_heads, capacity + 1, head_dim] per layer). Rows join and leave the running batch
without moving anyone else's cache (continuous batching); a slot's prefix can be copied into
another (the n responses of one prompt share one prefill); a finished slot keeps its cache for
the next turn of its conversation. The tensors never move, so a captured CUDA graph stays valid
across steps and weight updates.

`slot_attention` plugs into transformers' attention registry, so the model's own layers run
unchanged: each layer's new keys and values are written into their slots, then each query
attends over its slot up to its own position. Column `capacity` is scratch: rows that run in a
decode batch without a live sequence write there, and nobody reads it.

A mixture-of-experts model's cache can also keep, per slot and position, the experts each token was
routed to (`keep_routes`, R3 routing replay): they are written where the token's keys go, copied with a
shared prefix and kept with a finished sequence, so a sequence's routes cover its cached prefix too.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rl2.kernels.attention import NO_SINKS, available_attention, choose_attention, torch_varlen_attention
from rl2.kernels.sink_attention import SINK_MODEL_TYPES, masked_sink_attention, sink_window_attention

SLOT_ATTENTION = "rl2_kv_slots"
# Given as `attention_mask`, a dict makes the model skip building masks: the plans carry their own (a hybrid
# model's linear-attention layers, `linear_attention_slots`, need none).
NO_MASKS = {"full_attention": None, "sliding_attention": None, "linear_attention": None}


def no_masks(mrope: bool, device) -> dict | torch.Tensor:
    """The `attention_mask` that makes the model build no mask: `NO_MASKS`, or for a Qwen-VL model (whose
    text model builds its mask whatever the dict says) a 4-D placeholder it passes on as is; the slot
    attention ignores either."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device) if mrope else NO_MASKS


@dataclass
class DecodePlan:
    """One new token per row; row r is slot r, or slot `slots[r]` when given (the live slots only)."""

    write_positions: torch.Tensor  # [R] where each row's token goes (capacity: scratch, for idle rows)
    mask: torch.Tensor  # [R, 1, 1, kv_length] bool: the positions each row attends to
    kv_length: int  # positions read per row
    slots: torch.Tensor | None = None  # [R] each row's slot; None: the first R slots, read in place


@dataclass
class PrefillPlan:
    """The new tokens of several sequences packed in one row [1, T], and how they attend.

    `attention` names the kernel (`prefill_attention`): `sdpa_loop` runs one sdpa call per
    sequence over its slot; the packed kernels (`torch_varlen`, `flash_attention_2`) run one call over the whole row, with each sequence's keys packed after one
    another: its new tokens' keys as they come, or, where a cached prefix precedes them, the whole
    sequence gathered from its slot (`key_slots`, `key_positions`).
    """

    slots: torch.Tensor  # [T] the slot of each token
    positions: torch.Tensor  # [T] its position in its sequence
    segments: list[tuple[int, int, int, int]]  # per sequence: (slot, first position, start, end in the row)
    attention: str = "sdpa_loop"
    cu_q: torch.Tensor | None = None  # [n + 1] int32 bounds of each sequence's queries in the row
    cu_k: torch.Tensor | None = None  # [n + 1] int32 bounds of its keys (= cu_q without cached prefixes)
    max_q: int = 0
    max_k: int = 0
    key_slots: torch.Tensor | None = None  # [T_k] where each packed key is read from, if any sequence
    key_positions: torch.Tensor | None = None  # has a cached prefix; else the keys are the new tokens'

    @classmethod
    def build(cls, segments: list[tuple[int, int, int, int]], device, attention: str = "sdpa_loop") -> "PrefillPlan":
        """The plan of `segments` (slot, first position, start, end in the row) on `device`."""
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        slots, positions = [], []
        for slot, first, start, end in segments:
            slots += [slot] * (end - start)
            positions += range(first, first + end - start)
        plan = cls(as_tensor(slots), as_tensor(positions), segments, attention)
        if attention == "sdpa_loop":
            return plan
        q_lengths = [end - start for _, _, start, end in segments]
        k_lengths = [first + end - start for _, first, start, end in segments]
        bounds = lambda lengths: torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32)  # noqa: E731
        plan.cu_q, plan.cu_k, plan.max_q, plan.max_k = bounds(q_lengths), bounds(k_lengths), max(q_lengths), max(k_lengths)
        key_positions = positions
        if any(first > 0 for _, first, _, _ in segments):
            key_slots = [slot for (slot, *_), n in zip(segments, k_lengths) for _ in range(n)]
            key_positions = [p for n in k_lengths for p in range(n)]
            plan.key_slots, plan.key_positions = as_tensor(key_slots), as_tensor(key_positions)
        return plan


class KVSlots:
    """Per-layer key and value tensors [slots, kv_heads, capacity + 1, head_dim], grown on demand."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        self.num_layers, self.num_slots, self.kv_heads, self.head_dim = num_layers, num_slots, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # [moe layers, slots, capacity + 1, k] each cached token's experts (`keep_routes`); None: not kept
        self.routes: torch.Tensor | None = None
        self.route_shape: tuple[int, int, torch.dtype] | None = None  # (moe layers, k, dtype) when kept
        self.route_targets: tuple[torch.Tensor, torch.Tensor] | None = None  # (slots, positions) of this forward

    @classmethod
    def for_model(cls, model: nn.Module, num_slots: int) -> "KVSlots":
        config = model.config.get_text_config()  # a vision-language model's text model holds the cache
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, num_slots, kv_heads, head_dim, model.dtype, model.device)

    def bytes_per_position(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def reserve(self, capacity: int) -> bool:
        """Room for `capacity` positions per slot, keeping what the slots hold; True if the tensors
        were reallocated (anything that captured them must be rebuilt)."""
        if capacity <= self.capacity:
            return False
        shape = (self.num_slots, self.kv_heads, capacity + 1, self.head_dim)
        keys, values = [], []
        for layer in range(self.num_layers):
            for old, new in ((self.keys, keys), (self.values, values)):
                # zeros, not empty: idle rows attend over unused positions and must get finite values
                tensor = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old:
                    tensor[:, :, : self.capacity].copy_(old[layer][:, :, : self.capacity])
                    old[layer] = None  # free as we go
                new.append(tensor)
        if self.route_shape is not None:
            layers, k, dtype = self.route_shape
            routes = torch.full((layers, self.num_slots, capacity + 1, k), -1, dtype=dtype, device=self.device)
            if self.routes is not None:
                routes[:, :, : self.capacity].copy_(self.routes[:, :, : self.capacity])
            self.routes = routes
        self.keys, self.values, self.capacity = keys, values, capacity
        return True

    def release(self) -> None:
        """Free the tensors (their content is lost); `reserve` allocates them again."""
        self.keys, self.values, self.capacity, self.routes = [], [], 0, None

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Positions [0, length) of slot `source` into slot `target`, in every layer (and their routes)."""
        for tensors in (self.keys, self.values):
            for tensor in tensors:
                tensor[target, :, :length].copy_(tensor[source, :, :length])
        if self.routes is not None:
            self.routes[:, target, :length].copy_(self.routes[:, source, :length])

    # ---- routes (a mixture-of-experts model's, R3) -----------------------------------------------

    def keep_routes(self, layers: int, k: int, dtype: torch.dtype) -> None:
        """Keep each cached token's `k` experts in each of `layers` MoE layers (allocated by `reserve`; call
        before it, and before a decode graph is captured)."""
        if self.capacity:
            raise RuntimeError("keep_routes must come before the cache is allocated")
        self.route_shape = (layers, k, dtype)

    @contextmanager
    def routing_to(self, slots: torch.Tensor, positions: torch.Tensor) -> Iterator[None]:
        """Within it, the forward's tokens (in the order the routers see them) have their routes written to
        these slots and positions; outside, a forward of the model (a plain one) writes none."""
        self.route_targets = (slots, positions)
        try:
            yield
        finally:
            self.route_targets = None

    def write_routes(self, layer: int, experts: torch.Tensor) -> None:
        """One MoE layer's experts [tokens, k] for the forward's tokens (a `RoutingReplay` sink)."""
        if self.routes is None or self.route_targets is None:
            return
        slots, positions = self.route_targets
        self.routes[layer, slots, positions] = experts.to(self.routes.dtype)

    def routes_of(self, slot: int, length: int) -> torch.Tensor:
        """The routes of the first `length` tokens slot `slot` holds, [length, moe layers, k] on the CPU."""
        return self.routes[:, slot, :length].transpose(0, 1).to("cpu", copy=True)  # not a view of the cache on CPU


def slot_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kv_slots: KVSlots | None = None,
    kv_plan: DecodePlan | PrefillPlan | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention through the slot cache: query [B, heads, T, dim], key/value [B, kv_heads, T, dim]
    (this step's tokens) → output [B, T, heads, dim]. A `sliding_window` and attention sinks (`s_aux`,
    gpt-oss) apply as in transformers' eager attention. Without a plan (a plain forward of the
    engine's model) it is transformers' causal sdpa, or with sinks its eager arithmetic."""
    if kv_plan is None:
        if s_aux is not None:
            return _plain_sink_attention(query, key, value, attention_mask, scaling, s_aux, sliding_window), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    layer_keys, layer_values = kv_slots.keys[module.layer_idx], kv_slots.values[module.layer_idx]
    extras = (scaling, s_aux, sliding_window)
    if isinstance(kv_plan, DecodePlan):
        return _decode_attention(query, key, value, layer_keys, layer_values, kv_plan, *extras), None
    return _prefill_attention(query, key, value, layer_keys, layer_values, kv_plan, *extras), None


def _plain_sink_attention(query, key, value, attention_mask, scaling, sinks, window) -> torch.Tensor:
    """A plain forward's attention with sinks; `attention_mask` (bool, window included) or, if None, causal."""
    if attention_mask is None:
        return sink_window_attention(query, key, value, scaling, sinks, window).transpose(1, 2)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return masked_sink_attention(query, key, value, attention_mask, scaling, sinks.reshape(1, -1, 1, 1)).transpose(1, 2)


def _decode_attention(query, key, value, layer_keys, layer_values, plan: DecodePlan, scaling, sinks=None,
                      window=None) -> torch.Tensor:
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    index = torch.arange(rows, device=query.device) if plan.slots is None else plan.slots
    layer_keys[index, :, plan.write_positions] = key[:, :, 0]
    layer_values[index, :, plan.write_positions] = value[:, :, 0]
    read = slice(0, rows) if plan.slots is None else plan.slots  # views of the first R slots, or the given ones gathered
    keys, values = layer_keys[read, :, : plan.kv_length], layer_values[read, :, : plan.kv_length]
    # One query per row: the query heads that share a KV head become that head's queries, so
    # grouped-query attention needs no repeated keys (transformers' repeat_kv order: head h serves
    # query heads h*g .. h*g+g-1).
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    if sinks is None and window is None:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.mask, scale=scaling)
    else:
        visible = plan.mask
        if window is not None:  # each row's token is at its write position
            positions = torch.arange(plan.kv_length, device=query.device)
            visible = visible & (positions > plan.write_positions[:, None, None, None] - window)
        grouped_sinks = None if sinks is None else sinks.reshape(1, kv_heads, heads // kv_heads, 1)
        out = masked_sink_attention(grouped, keys, values, visible, scaling, grouped_sinks)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2)


def _prefill_attention(query, key, value, layer_keys, layer_values, plan: PrefillPlan, scaling, sinks=None,
                       window=None) -> torch.Tensor:
    # [1, kv_heads, T, dim] → [T, kv_heads, dim], the layout of cache[slot, :, position]
    layer_keys[plan.slots, :, plan.positions] = key[0].transpose(0, 1)
    layer_values[plan.slots, :, plan.positions] = value[0].transpose(0, 1)
    if plan.attention != "sdpa_loop":
        return _packed_prefill_attention(query, key, value, layer_keys, layer_values, plan, scaling, window)
    grouped = query.shape[1] != key.shape[1]
    outputs = []
    for slot, first, start, end in plan.segments:
        length = first + end - start
        keys = layer_keys[slot : slot + 1, :, :length]
        values = layer_values[slot : slot + 1, :, :length]
        if sinks is not None or window is not None:  # the new tokens are the last of the sequence's positions
            outputs.append(sink_window_attention(query[:, :, start:end], keys, values, scaling, sinks, window))
            continue
        if first == 0:
            mask, causal = None, True
        else:  # the new tokens at positions first.. see the cached prefix and each other causally
            positions = torch.arange(length, device=query.device)
            mask, causal = positions[None, :] <= positions[first:, None], False
        outputs.append(F.scaled_dot_product_attention(
            query[:, :, start:end], keys, values, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=grouped
        ))
    return torch.cat(outputs, dim=2).transpose(1, 2)


def _packed_prefill_attention(query, key, value, layer_keys, layer_values, plan: PrefillPlan, scaling,
                              window=None) -> torch.Tensor:
    """One kernel call over the packed row: query [1, heads, T, dim] → [1, T, heads, dim]."""
    if plan.key_slots is not None:  # whole sequences, cached prefixes included: [T_k, kv_heads, dim] → [1, kv_heads, T_k, dim]
        key = layer_keys[plan.key_slots, :, plan.key_positions].transpose(0, 1)[None]
        value = layer_values[plan.key_slots, :, plan.key_positions].transpose(0, 1)[None]
    if plan.attention == "torch_varlen":
        out, _ = torch_varlen_attention(None, query, key, value, None, scaling, cu_seq_lens_q=plan.cu_q,
                                        max_length_q=plan.max_q, cu_seq_lens_k=plan.cu_k, max_length_k=plan.max_k,
                                        sliding_window=window)
        return out
    if plan.attention == "flash_attention_2":
        from flash_attn import flash_attn_varlen_func  # causal is aligned to the end of each sequence's keys

        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
        left = -1 if window is None else window - 1  # flash-attn's window excludes the query itself
        return flash_attn_varlen_func(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, softmax_scale=scaling,
                                      causal=True, window_size=(left, 0))[None]
    raise ValueError(f"unknown prefill attention {plan.attention!r}")


def prefill_attention(device: torch.device, requested: str = "auto", available: dict[str, bool] | None = None,
                      dtype: torch.dtype | None = None, model_type: str | None = None) -> str:
    """The kernel the engine prefills with on `device` for a model in `dtype` (one of ATTENTION_CHOICES):
    `auto` takes flash-attn, else torch's varlen kernel on CUDA in half precision, and the per-sequence
    loop elsewhere (always for a model with attention sinks, `model_type` in SINK_MODEL_TYPES, which the
    flash kernels lack; asking for one of them is refused). Flex attention is
    refused: the engine's rows change length every call, so it would run uncompiled and materialise every
    score (compiled, it would recompile per row length)."""
    if requested == "flex_attention":
        raise ValueError("rollout.attn_implementation=flex_attention: the engine's prefill rows change length every "
                         "call, so flex attention would run uncompiled over the full score matrix; use auto, "
                         "flash_attention_2, torch_varlen or sdpa_loop (flex attention stays available for training)")
    if requested == "auto":
        available = available if available is not None else available_attention(device, dtype)
        if device.type == "cuda" and model_type not in SINK_MODEL_TYPES:
            return next(name for name in (*NO_SINKS, "sdpa_loop") if available[name])
        return "sdpa_loop"
    return choose_attention(device, requested, available, dtype, model_type)


def register_slot_attention() -> str:
    """Register `slot_attention` with transformers; returns its name for `attn_implementation`."""
    AttentionInterface.register(SLOT_ATTENTION, slot_attention)
    AttentionMaskInterface.register(SLOT_ATTENTION, sdpa_mask)  # for plain forwards of the engine's model
    return SLOT_ATTENTION
