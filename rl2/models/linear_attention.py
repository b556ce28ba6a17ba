"""Hybrid models' linear-attention layers in packed rows: each sequence run on its own.

A gated delta-net layer (Qwen3.5, Qwen3-Next) is a recurrence over the whole row, after a short causal
convolution: in a packed row it carries state from one sequence into the next, and transformers' own
torch path refuses a row with sequence boundaries (`chunk_gated_delta_rule can't keep packed sequences
apart without flash-linear-attention`). `PerSequenceLinearAttention(model)` replaces, on that model
instance only, each such layer's forward by one that splits a packed row at its sequence starts and runs
the layer's own forward on the sequences (those of one length batched together), so state and
convolution restart at every sequence and each gives what it gives alone. The full-attention layers are
untouched and keep rl2's varlen attention. `close()` (or leaving its `with` block) puts the forwards back.

Boundaries come from `cu_seq_lens_q`, as rl2's packed forward passes it, else from the layer's
`position_ids` (restarting at 0 per sequence). A batch of several rows, or a forward with a cache
(generation), goes to the layer's own forward unchanged.
"""

import functools

import torch
from torch import nn

from rl2.kernels.attention import cu_seqlens_from_position_ids

# Keyword arguments of a packed forward that describe its sequences: the layer's own forward must not see
# them (its torch path raises on `cu_seq_lens_q`), the split makes them unnecessary.
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def is_linear_attention(module: nn.Module) -> bool:
    """Whether `module` is a linear-attention mixer this path knows (the gated delta-nets)."""
    return type(module).__name__.endswith("GatedDeltaNet")


class PerSequenceLinearAttention:
    """The per-sequence path installed on one model's linear-attention layers (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.layers = [(parent, child) for parent in model.modules()
                       for child in parent.children() if is_linear_attention(child)]
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no linear-attention layer (gated delta-net)")
        self._saved = []
        self._handles = []
        for parent, mixer in self.layers:
            self._saved.append(mixer.__dict__.get("forward"))
            mixer.forward = functools.partial(_per_sequence_forward, mixer.forward)
            self._handles.append(parent.register_forward_pre_hook(_bounds_from_position_ids, with_kwargs=True))

    def close(self) -> None:
        """Put the layers' own forwards back."""
        for handle in self._handles:
            handle.remove()
        for (_, mixer), saved in zip(self.layers, self._saved):
            if saved is None:
                del mixer.forward
            else:
                mixer.forward = saved
        self._handles, self._saved, self.layers = [], [], []

    def __enter__(self) -> "PerSequenceLinearAttention":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bounds_from_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A decoder layer's pre-hook: `cu_seq_lens_q` from its `position_ids` when the caller gave none."""
    position_ids = kwargs.get("position_ids")
    if kwargs.get("cu_seq_lens_q") is not None or position_ids is None or position_ids.dim() != 2:
        return None
    if position_ids.shape[0] != 1:
        return None
    return args, {**kwargs, "cu_seq_lens_q": cu_seqlens_from_position_ids(position_ids)}


def _per_sequence_forward(layer_forward, *args, **kwargs) -> torch.Tensor:
    """`layer_forward` (a linear-attention layer's own, bound) run on each sequence of a packed row."""
    bounds = kwargs.get("cu_seq_lens_q")
    kwargs = {name: value for name, value in kwargs.items() if name not in PACKING_KWARGS}
    if "hidden_states" in kwargs:
        hidden_states, rest = kwargs.pop("hidden_states"), args
    else:
        hidden_states, rest = args[0], args[1:]
    cache = kwargs.get("cache", kwargs.get("cache_params"))
    edges = bounds.tolist() if bounds is not None else [0, hidden_states.shape[1]]
    if cache is not None or hidden_states.shape[0] != 1 or len(edges) <= 2:
        return layer_forward(hidden_states, *rest, **kwargs)
    mask = kwargs.pop("attention_mask", None)

    def run(take) -> torch.Tensor:
        """The layer on sequences of one length, batched (`take`: [1, T, ...] -> [count, length, ...])."""
        piece = {"attention_mask": take(mask)} if mask is not None else {}
        out = layer_forward(take(hidden_states), *rest, **kwargs, **piece)  # [count, length, hidden]
        return out.reshape(-1, out.shape[-1])

    starts_of: dict[int, list[int]] = {}  # sequences by length: those of one length run as one batch
    runs: list[list[int]] = []  # [length, start, count] of consecutive sequences of one length
    for start, end in zip(edges[:-1], edges[1:]):
        starts_of.setdefault(end - start, []).append(start)
        if runs and runs[-1][0] == end - start:
            runs[-1][2] += 1
        else:
            runs.append([end - start, start, 1])
    if len(runs) == len(starts_of):  # each length in one run (rl2 packs a row by length): slices, in order
        return torch.cat([run(lambda t: t[0, start:start + count * length].unflatten(0, (count, length)))
                          for length, start, count in runs]).unsqueeze(0)
    outputs, positions = [], []
    for length, starts in starts_of.items():
        index = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).to(hidden_states.device)  # [count, length]
        outputs.append(run(lambda t: t[0, index]))
        positions.append(index.reshape(-1))
    order = torch.argsort(torch.cat(positions))
    return torch.cat(outputs)[order].unsqueeze(0)


def has_linear_attention(model: nn.Module) -> bool:
    """Whether `model` has a gated delta-net layer."""
    return any(is_linear_attention(module) for module in model.modules())


def varlen_kernels_available(device: torch.device) -> bool:
    """Whether transformers' gated delta-net layers can keep packed sequences apart themselves: on CUDA with
    flash-linear-attention's varlen delta rule and the causal-conv1d kernels installed (the `gpu` extra)."""
    import importlib.util

    return device.type == "cuda" and all(importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d"))


def install_packed_linear_attention(model: nn.Module, device: torch.device) -> PerSequenceLinearAttention | None:
    """The per-sequence path on `model`'s linear-attention layers, where it has some and the varlen kernels
    are not in use (see `varlen_kernels_available`); None otherwise."""
    if not has_linear_attention(model) or varlen_kernels_available(device):
        return None
    return PerSequenceLinearAttention(model)
