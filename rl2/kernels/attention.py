"""Variable-length causal attention for packed rows, plugged into transformers' attention registry.

transformers' sdpa path handles a packed row by building a block-diagonal T×T mask from
`position_ids` and computing attention over the whole row: packing then costs (Σ L)² instead of
Σ L². The implementations here stay within each sequence:

- `flash_attention_2`: transformers' own, flash-attn's varlen kernel (CUDA, when installed);
- `torch_varlen`: torch's variable-length flash kernel (`torch.nn.attention.varlen`, CUDA, torch ≥ 2.10);
- `flex_attention`: transformers' own flex attention, whose block mask keeps each packed sequence
  apart (from `position_ids`); compiled, on CUDA and CPU;
- `sdpa_loop`: one sdpa call per sequence length (`varlen_attention`: the sequences of a length batched), anywhere.

`auto` takes the first available in that order on CUDA and `sdpa_loop` on CPU, where it is the
fastest (bench/RESULTS.md). Sliding windows apply within each sequence in all four. Attention sinks
(gpt-oss) are computed by `sdpa_loop` (exactly as transformers' eager attention, `sink_attention`) and
by transformers' flex attention on CUDA only: for such a model `auto` skips the two flash kernels.
"""

import importlib.util
import inspect
import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from rl2.config import ATTENTION_CHOICES
from rl2.errors import ConfigError
from rl2.kernels.sink_attention import SINK_MODEL_TYPES, sink_window_attention

logger = logging.getLogger(__name__)

VARLEN_ATTENTION = "rl2_varlen"
TORCH_VARLEN_ATTENTION = "rl2_torch_varlen"


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
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention restricted to each sequence of a packed row.

    query [1, heads, T, dim], key/value [1, kv_heads, T, dim] → output [1, T, heads, dim]. The
    boundaries come from `cu_seq_lens_q` if given, else from `position_ids`, else the row is one
    sequence. A `sliding_window` and attention sinks (`s_aux`, gpt-oss) apply within each sequence.
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
    if sliding_window is not None and max(end - start for start, end in zip(bounds, bounds[1:])) <= sliding_window:
        sliding_window = None  # no sequence reaches past it
    if s_aux is None and sliding_window is None:
        attention = lambda q, k, v: _causal_sdpa(q, k, v, dropout, scaling)  # noqa: E731
    else:
        attention = lambda q, k, v: sink_window_attention(q, k, v, scaling, s_aux, sliding_window, dropout)  # noqa: E731
    if len(bounds) == 2:  # one sequence
        return attention(query, key, value).transpose(1, 2).contiguous(), None
    starts_of: dict[int, list[int]] = {}  # sequences by length
    runs: list[list[int]] = []  # [length, start, count] of consecutive sequences of one length
    for start, end in zip(bounds[:-1], bounds[1:]):
        starts_of.setdefault(end - start, []).append(start)
        if runs and runs[-1][0] == end - start:
            runs[-1][2] += 1
        else:
            runs.append([end - start, start, 1])
    # Sequences of one length attend in one batched call (one call per sequence costs more on CPU for many
    # short ones); each batch element is computed as alone, so the result is the per-sequence loop's.
    def attend(take, count: int, length: int) -> torch.Tensor:
        """`count` sequences of `length` tokens (`take`: a row's [heads, T, dim] -> theirs) in one call ->
        [heads, count * length, dim]."""
        batched = [take(t[0]).unflatten(1, (count, length)).transpose(0, 1) for t in (query, key, value)]
        out = attention(*batched)  # [count, heads, length, dim]
        return out.transpose(0, 1).reshape(out.shape[1], -1, out.shape[3])

    if len(runs) == len(starts_of):  # each length in one run (rows packed by length): batches are slices
        outputs = [attend(lambda t: t[:, start:start + count * length], count, length) for length, start, count in runs]
        return torch.cat(outputs, dim=1).unsqueeze(0).transpose(1, 2).contiguous(), None
    outputs, positions = [], []
    for length, starts in starts_of.items():
        index = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).reshape(-1).to(query.device)
        outputs.append(attend(lambda t: t[:, index], len(starts), length))
        positions.append(index)
    order = torch.argsort(torch.cat(positions))
    return torch.cat(outputs, dim=1)[:, order].unsqueeze(0).transpose(1, 2).contiguous(), None


def _causal_sdpa(query, key, value, dropout: float, scaling: float | None) -> torch.Tensor:
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, dropout_p=dropout, scale=scaling,
                                          enable_gqa=query.shape[1] != key.shape[1])


def _sequence_bounds(query: torch.Tensor, cu_seq_lens_q: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor:
    if cu_seq_lens_q is not None:
        return cu_seq_lens_q
    if position_ids is not None:
        return cu_seqlens_from_position_ids(position_ids)
    return torch.tensor([0, query.shape[2]], dtype=torch.int32)


def torch_varlen_kernel():
    """torch's variable-length attention function, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def torch_varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    position_ids: torch.Tensor | None = None,
    kernel=None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_k: int | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each sequence of a packed row through torch's varlen flash kernel.

    Shapes and boundaries as in `varlen_attention`; `max_length_q` (the longest sequence) saves a
    device-to-host copy per layer when given. With `cu_seq_lens_k` (and `max_length_k`) each
    sequence's keys may be longer than its queries: the queries are its last tokens, and the causal
    mask is aligned to the end (the flash kernels' convention). A `sliding_window` of W keeps each
    query's W latest keys; attention sinks (`s_aux`) are refused. `kernel` replaces `torch_varlen_kernel()` (tests).
    """
    if query.shape[0] != 1:
        raise ValueError(f"{TORCH_VARLEN_ATTENTION} attention takes packed rows of batch size 1, got {query.shape[0]}")
    if dropout != 0.0:
        raise ValueError(f"{TORCH_VARLEN_ATTENTION} attention has no dropout (got {dropout})")
    if s_aux is not None:
        raise ValueError(f"{TORCH_VARLEN_ATTENTION} attention has no attention sinks (s_aux): use flex attention")
    kernel = kernel or torch_varlen_kernel()
    bounds = _sequence_bounds(query, cu_seq_lens_q, position_ids).to(device=query.device, dtype=torch.int32)
    longest = max_length_q or int((bounds[1:] - bounds[:-1]).max())
    key_bounds, longest_key = bounds, longest
    if cu_seq_lens_k is not None:
        key_bounds = cu_seq_lens_k.to(device=query.device, dtype=torch.int32)
        longest_key = max_length_k or int((key_bounds[1:] - key_bounds[:-1]).max())
    # [1, heads, T, dim] → [T, heads, dim], the kernel's layout
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    # Grouped-query K/V go in as they are: torch >= 2.13 asks for `enable_gqa`; torch 2.10-2.12 have no such
    # argument and call aten's flash kernel directly, which takes fewer KV heads than query heads (and sums
    # their gradients over each group) without being told.
    grouped = {}
    if q.shape[1] != k.shape[1] and "enable_gqa" in inspect.signature(kernel).parameters:
        grouped["enable_gqa"] = True
    left = -1 if sliding_window is None else sliding_window - 1  # the kernel's window excludes the query itself
    out = kernel(q, k, v, bounds, key_bounds, longest, longest_key, scale=scaling, window_size=(left, 0), **grouped)
    return out.unsqueeze(0), None


def no_dense_mask(*args, **kwargs) -> None:
    """Mask function for attention that takes boundaries from the sequence lengths: no dense mask."""
    return None


def flash_attn_loads() -> bool:
    """Whether flash-attn is installed and its compiled kernels load. A flash-attn built for another torch
    (as after `pip install sglang`, which pins its own torch) is found by `find_spec` but fails with an
    `undefined symbol` at its import or first call: it is then not used, with a warning."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        importlib.import_module("flash_attn_2_cuda")  # the compiled part, where a torch mismatch shows
        importlib.import_module("flash_attn").flash_attn_varlen_func
    except Exception as error:  # ImportError, OSError (undefined symbol), AttributeError
        logger.warning(f"flash-attn is installed but does not load ({type(error).__name__}: {error}); not using it")
        return False
    return True


HALF_PRECISION = (torch.float16, torch.bfloat16)
NO_SINKS = ("flash_attention_2", "torch_varlen")  # kernels without attention sinks (flex attention has them on CUDA)


def available_attention(device: torch.device, dtype: torch.dtype | None = None) -> dict[str, bool]:
    """Which packed-row attention implementations can run on `device` in `dtype` (None: any dtype).
    The flash kernels (flash-attn's and torch's varlen) take fp16/bf16 only."""
    flash = device.type == "cuda" and (dtype is None or dtype in HALF_PRECISION)
    return {
        "flash_attention_2": flash and flash_attn_loads(),
        "torch_varlen": flash and torch_varlen_kernel() is not None,
        "flex_attention": importlib.util.find_spec("torch.nn.attention.flex_attention") is not None,
        "sdpa_loop": True,
    }


def choose_attention(device: torch.device, requested: str = "auto", available: dict[str, bool] | None = None,
                     dtype: torch.dtype | None = None, model_type: str | None = None) -> str:
    """The implementation `requested` (one of ATTENTION_CHOICES) resolves to on `device` for a model
    computing in `dtype`; an error names what is missing when an explicit choice cannot run there.
    A model with attention sinks (`model_type` in SINK_MODEL_TYPES: gpt-oss) needs a kernel that computes
    them: `auto` then skips flash-attn 2's and torch's varlen kernels, and asking for either is refused."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"attn_implementation must be one of {ATTENTION_CHOICES}, got {requested!r}")
    sinks = model_type in SINK_MODEL_TYPES
    if sinks and requested in NO_SINKS:
        raise ConfigError(f"attn_implementation={requested} cannot run {model_type}: its attention sinks are not in "
                          f"{requested}'s kernel; use auto, flex_attention or sdpa_loop")
    available = available if available is not None else available_attention(device, dtype)
    if requested == "auto":
        if device.type != "cuda":
            return "sdpa_loop"
        return next(name for name in ATTENTION_CHOICES[1:] if available[name] and not (sinks and name in NO_SINKS))
    if not available[requested]:
        needs = {"flash_attention_2": "CUDA and the flash-attn package", "torch_varlen": "CUDA and torch >= 2.10",
                 "flex_attention": "torch >= 2.5"}[requested]
        if requested != "flex_attention" and device.type == "cuda" and dtype not in (None, *HALF_PRECISION):
            needs = f"bfloat16 or float16 (the model computes in {str(dtype).removeprefix('torch.')})"
        raise ValueError(f"attn_implementation={requested} cannot run on {device.type}: it needs {needs}")
    return requested


def packed_attention_implementation(device: torch.device, requested: str = "auto",
                                    dtype: torch.dtype | None = None, model_type: str | None = None) -> str:
    """The transformers attention name for packed training rows on `device` in `dtype` for a model of
    `model_type` (see `choose_attention`), registering ours where needed; logs the choice."""
    choice = choose_attention(device, requested, dtype=dtype, model_type=model_type)
    logger.info(f"packed-row attention on {device.type}: {choice}" + (" (auto)" if requested == "auto" else ""))
    if choice == "sdpa_loop":
        AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
        AttentionMaskInterface.register(VARLEN_ATTENTION, no_dense_mask)
        return VARLEN_ATTENTION
    if choice == "torch_varlen":
        AttentionInterface.register(TORCH_VARLEN_ATTENTION, torch_varlen_attention)
        AttentionMaskInterface.register(TORCH_VARLEN_ATTENTION, no_dense_mask)
        return TORCH_VARLEN_ATTENTION
    return choice  # transformers' own
