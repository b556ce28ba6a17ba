"""Sampling the next token with a random stream per request, so a request's samples do not
depend on which others share its batch, where its KV slot is, or how it was batched.

Each row draws one uniform number from a counter-based hash of (call key, request, token index)
and takes the token where it falls in the cumulative distribution (inverse-CDF sampling). The
call key comes from the engine's seeded generator, once per `generate` call.
"""

import torch

from rl2.engines.base import SamplingParams

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The murmur3 finaliser on int64 tensors holding 32-bit values: a bijection that scrambles every bit."""
    # Products wrap modulo 2**64; only the low 32 bits are kept.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def request_uniforms(call_key: int, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A uniform number in (0, 1) for each (request, token position), float64, from `call_key`."""
    x = _mix32((requests.long() & _MASK32) ^ (call_key & _MASK32))
    x = _mix32((x + positions.long() * 0x9E3779B1) & _MASK32)
    x = _mix32(x ^ ((call_key >> 32) & _MASK32))
    return (x.double() + 0.5) / 2.0**32


def sample(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens [B] from last-position logits [B, V] and one uniform number per row [B], and
    their log-probs under softmax(logits / T).

    Temperature 0 is greedy (log-probs at T = 1). top_k then top_p restrict what is sampled, not
    the reported log-probs.
    """
    logits = logits.float()
    if params.temperature == 0:
        next_tokens = logits.argmax(-1)
        logps = torch.log_softmax(logits, -1)
    else:
        logits = logits / params.temperature
        logps = torch.log_softmax(logits, -1)
        filtered = filter_top_k_top_p(logits, params.top_k, params.top_p)
        cdf = filtered.softmax(-1).double().cumsum(-1)
        targets = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(-1)
        next_tokens = torch.searchsorted(cdf, targets).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    return next_tokens, logps.gather(-1, next_tokens[:, None]).squeeze(-1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`logits` with -inf outside the top_k tokens, then outside the nucleus of mass top_p.

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p; it
    always holds the most likely token.
    """
    if top_k != -1 and top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = logits.sort(-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        outside_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before it already reaches top_p
        outside = outside_sorted.scatter(-1, sorted_index, outside_sorted)
        logits = logits.masked_fill(outside, float("-inf"))
    return logits
