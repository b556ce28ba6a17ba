"""Hybrid models' linear-attention state in the hf engine's slots, beside the KV slots.

A hybrid model (Qwen3.5, Qwen3-Next) has gated delta-net layers beside its full-attention ones. Such a
layer keeps no keys and values: a sequence's past is a short convolution state (its last `kernel` inputs)
and a recurrent state (one matrix per head). `LinearAttentionSlots(model, slots)` holds both per slot, per
layer, in preallocated tensors, and replaces, on that model instance only, each layer's forward by one that
reads and writes them when the engine passes its slot plans (`kv_plan`); a plain forward runs the layer's
own forward unchanged. The layer's own forward does the work: it is handed a small stand-in for
transformers' cache (`_States`) holding the states of the sequences it runs on.

- Prefill (a `PrefillPlan`: several sequences packed in one row): each sequence runs on its own (those of
  one length and kind batched), so no state crosses from one into the next. A sequence that starts at
  position 0 starts from no state, whatever its slot held before; one that continues its slot's contents (a
  conversation's next turn) starts from the slot's state.
- Decode (a `DecodePlan`: one token per row): every row's state advances, and is written back only for live
  rows (those not writing to the KV cache's scratch column), so kept slots keep their state.

A state describes the end of what its slot holds and cannot be cut back: the engine reuses a prefix of a
hybrid model's slot only when it is the slot's whole contents (`HFEngine._shareable`), and copies of a prompt
prefilled in one round take the first's slot after the prefill (`HFEngine._copy_twins`).
"""

import functools

import torch
from torch import nn

from rl2.engines.kv_slots import DecodePlan, PrefillPlan
from rl2.models.linear_attention import PACKING_KWARGS, is_linear_attention


class LinearAttentionSlots:
    """Per linear-attention layer: conv states [slots, conv_dim, kernel] in the model's dtype and recurrent
    states [slots, value_heads, key_dim, value_dim] in fp32 (as the delta rule computes them)."""

    def __init__(self, model: nn.Module, num_slots: int):
        self.layers = [module for module in model.modules() if is_linear_attention(module)]
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no linear-attention layer (gated delta-net)")
        self.num_slots, self.dtype, self.device = num_slots, model.dtype, model.device
        self.conv: dict[int, torch.Tensor] = {}  # layer_idx -> [slots, conv_dim, kernel]
        self.recurrent: dict[int, torch.Tensor] = {}  # layer_idx -> [slots, value_heads, key_dim, value_dim]
        for layer in self.layers:
            layer.forward = functools.partial(_slot_forward, self, layer.layer_idx, layer.forward)

    @classmethod
    def for_model(cls, model: nn.Module, num_slots: int) -> "LinearAttentionSlots | None":
        """The slots of `model`'s linear-attention layers, installed on it; None if it has none."""
        if not any(is_linear_attention(module) for module in model.modules()):
            return None
        return cls(model, num_slots)

    def allocate(self) -> bool:
        """Allocate the state tensors if they are not (after `release`); True if they were (anything that
        captured the old ones must be rebuilt)."""
        if self.conv:
            return False
        for layer in self.layers:
            self.conv[layer.layer_idx] = torch.zeros(
                self.num_slots, layer.conv_dim, layer.conv_kernel_size, dtype=self.dtype, device=self.device)
            self.recurrent[layer.layer_idx] = torch.zeros(
                self.num_slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, dtype=torch.float32,
                device=self.device)
        return True

    def release(self) -> None:
        """Free the tensors (their content is lost); `allocate` makes them again."""
        self.conv, self.recurrent = {}, {}

    def copy(self, source: int, target: int) -> None:
        """Slot `source`'s states into slot `target`, in every layer."""
        for tensors in (self.conv, self.recurrent):
            for tensor in tensors.values():
                tensor[target].copy_(tensor[source])


class _States:
    """What a gated delta-net layer's forward asks of its cache, over the states of the sequences it runs on
    ([B, ...]; None: no past). Updates mirror transformers' `LinearAttentionLayer`: the conv state keeps the
    last `kernel` inputs (zero-padded on the left), the recurrent state is replaced."""

    def __init__(self, conv: torch.Tensor | None = None, recurrent: torch.Tensor | None = None):
        self.conv, self.recurrent = conv, recurrent

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(self, inputs: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """Record the new inputs [B, conv_dim, T]; returns them after the past the convolution needs."""
        if self.conv is None:
            full = inputs
            if full.shape[-1] < conv_kernel_size:
                full = torch.nn.functional.pad(full, (conv_kernel_size - full.shape[-1], 0))
        else:
            full = torch.cat([self.conv, inputs], dim=-1)
        self.conv = full[..., -conv_kernel_size:]
        return full

    def update_recurrent_state(self, recurrent: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self.recurrent = recurrent
        return recurrent


def _slot_forward(slots: LinearAttentionSlots, layer_idx: int, layer_forward, *args, **kwargs) -> torch.Tensor:
    """A linear-attention layer's forward (`layer_forward`, its own) over the engine's slots when given a plan."""
    plan = kwargs.get("kv_plan")
    if plan is None:
        return layer_forward(*args, **kwargs)
    kv_slots = kwargs.get("kv_slots")
    hidden_states = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
    dropped = {"kv_plan", "kv_slots", "cache", "cache_params", "position_ids", *PACKING_KWARGS}
    kwargs = {name: value for name, value in kwargs.items() if name not in dropped}
    conv, recurrent = slots.conv[layer_idx], slots.recurrent[layer_idx]

    def run(states: _States, inputs: torch.Tensor) -> torch.Tensor:
        return layer_forward(hidden_states=inputs, cache=states, **kwargs)

    if isinstance(plan, DecodePlan):  # hidden_states [R, 1, hidden]
        rows = hidden_states.shape[0]
        index = slice(0, rows) if plan.slots is None else plan.slots
        old_conv, old_recurrent = conv[index], recurrent[index]
        states = _States(old_conv.clone(), old_recurrent)  # a clone: the conv update writes in place
        out = run(states, hidden_states)
        live = plan.write_positions < kv_slots.capacity  # idle rows write the KV scratch column
        conv[index] = torch.where(live[:, None, None], states.conv, old_conv)
        recurrent[index] = torch.where(live[:, None, None, None], states.recurrent, old_recurrent)
        return out
    assert isinstance(plan, PrefillPlan)
    # hidden_states [1, T, hidden]: sequences of one length and kind (fresh, or continuing their slot) run batched
    groups: dict[tuple[int, bool], list[tuple[int, int]]] = {}
    for slot, first, start, end in plan.segments:
        groups.setdefault((end - start, first == 0), []).append((slot, start))
    out = torch.empty_like(hidden_states)
    for (length, fresh), members in groups.items():
        rows = torch.tensor([slot for slot, _ in members], device=hidden_states.device)
        starts = torch.tensor([start for _, start in members], device=hidden_states.device)
        positions = starts[:, None] + torch.arange(length, device=hidden_states.device)  # [count, length]
        states = _States() if fresh else _States(conv[rows], recurrent[rows])
        out[0, positions] = run(states, hidden_states[0, positions])
        conv[rows] = states.conv.to(conv.dtype)
        recurrent[rows] = states.recurrent.to(recurrent.dtype)
    return out
