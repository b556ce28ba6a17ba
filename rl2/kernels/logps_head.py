"""Per-token log-probs and entropy of a causal LM's next tokens, computed from its final hidden states in
token chunks: no `[T, vocab]` fp32 logits are held, in forward or in backward.

At Qwen's 151,936-token vocabulary one fp32 copy of the logits of 16k tokens is 9.3 GiB, and the plain
computation holds several (logits, log-softmax, its exponential for the entropy, the gradient). Here each
chunk of tokens is projected, reduced to what is kept (the next token's log-prob, the logsumexp, the
entropy) and dropped; backward recomputes each chunk's logits (one more matmul per chunk, as activation
checkpointing does for a layer).

With `fused` (set by `actor.compile`) the softmax work on each chunk's logits runs as two compiled
functions (`FusedChunkOps`): each reads the chunk's low-precision logits once, where the eager path
makes an fp32 copy and passes over it five to seven times. Profiled on an H200 (1.5B, 68k tokens a
step), those passes were about a fifth of the step's kernel time.

liger-kernel's fused linear cross-entropy is not dispatched to even where installed: it returns no
entropy, and RL losses need its per-token mode (`reduction="none"`), whose backward in older releases
scales gradients already summed over tokens, which is wrong for per-token weights and raises no error.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    return logits / temperature if temperature != 1.0 else logits


def chunk_stats(logits: torch.Tensor, next_ids: torch.Tensor, temperature: float, with_entropy: bool):
    """A chunk's logits [N, V] (any float dtype) → the next tokens' log-probs, the logsumexp and, with
    `with_entropy`, the entropy (each fp32 [N]; None without), at `temperature`. Written to be compiled."""
    z = logits.float() / temperature
    logsumexp = torch.logsumexp(z, dim=-1)
    logps = z.gather(-1, next_ids[:, None]).squeeze(-1) - logsumexp
    entropy = logsumexp - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None  # H = lse − Σ p z
    return logps, logsumexp, entropy


def chunk_logits_grad(logits, next_ids, logsumexp, grad_logps, temperature: float, entropy=None, grad_entropy=None):
    """The gradient of Σ grad_logps·logp(next) (+ Σ grad_entropy·H with `entropy`) with respect to a chunk's
    logits [N, V], in the logits' dtype. Written to be compiled."""
    log_probs = logits.float() / temperature - logsumexp[:, None]
    probs = log_probs.exp()
    grad = -probs * grad_logps[:, None]
    if entropy is not None:  # d H / dz = −p (log p + H)
        grad = grad - probs * (log_probs + entropy[:, None]) * grad_entropy[:, None]
    grad = grad.scatter_add(-1, next_ids[:, None], grad_logps[:, None])
    return (grad / temperature).to(logits.dtype)


class FusedChunkOps:
    """`chunk_stats` and `chunk_logits_grad` compiled (dynamic shapes: chunks and rows vary in length)."""

    def __init__(self):
        self.stats = torch.compile(chunk_stats, dynamic=True)
        self.logits_grad = torch.compile(chunk_logits_grad, dynamic=True)


def _eager_logits_grad(ctx, hidden, weight, next_ids, logsumexp, entropy, grad_logps, grad_entropy, start, end):
    """`chunk_logits_grad` for tokens start..end, eagerly and in place (one fp32 [N, V] buffer, two with
    the entropy's gradient)."""
    grad = grad_logps[start:end, None]
    # d log p(y) / dz = onehot(y) − softmax(z); z = logits / temperature
    grad_logits = _chunk_logits(hidden[start:end], weight, ctx.temperature)
    if grad_entropy is not None:
        # d H / dz = −p (log p + H), H = −Σ p log p
        log_probs = grad_logits.sub_(logsumexp[start:end, None])
        probs = log_probs.exp()
        grad_logits = probs * (-grad)
        grad_logits.sub_(probs.mul_(log_probs.add_(entropy[start:end, None])).mul_(grad_entropy[start:end, None]))
    else:
        grad_logits.sub_(logsumexp[start:end, None]).exp_().mul_(-grad)
    grad_logits.scatter_add_(-1, next_ids[start:end, None], grad)
    if ctx.temperature != 1.0:
        grad_logits.div_(ctx.temperature)
    return grad_logits.to(hidden.dtype)


class ChunkedTokenLogps(torch.autograd.Function):
    """hidden [T, H], weight [V, H], next_ids [T] → log softmax(hidden·weightᵀ / temperature)[next_id]
    [T] (fp32, differentiable) and, with `with_entropy`, the entropy of that softmax [T] (fp32,
    differentiable with `entropy_grad`; else None). With `fused` (a `FusedChunkOps`) each chunk's softmax
    work runs compiled; without, eagerly in place."""

    @staticmethod
    def forward(ctx, hidden, weight, next_ids, temperature, chunk_size, with_entropy, entropy_grad=False, fused=None):
        length = hidden.shape[0]
        logps = torch.empty(length, dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(logps)
        entropy = torch.empty_like(logps) if with_entropy else None
        for start in range(0, length, chunk_size):
            end = min(start + chunk_size, length)
            if fused is not None:
                chunk = fused.stats(F.linear(hidden[start:end], weight), next_ids[start:end], temperature, with_entropy)
                logps[start:end], logsumexp[start:end] = chunk[0], chunk[1]
                if with_entropy:
                    entropy[start:end] = chunk[2]
                continue
            logits = _chunk_logits(hidden[start:end], weight, temperature)
            chunk_lse = torch.logsumexp(logits, dim=-1)
            logsumexp[start:end] = chunk_lse
            logps[start:end] = logits.gather(-1, next_ids[start:end, None]).squeeze(-1) - chunk_lse
            if with_entropy:
                log_probs = logits.sub_(chunk_lse[:, None])
                entropy[start:end] = -torch.linalg.vecdot(log_probs.exp(), log_probs)
        entropy_grad = entropy_grad and with_entropy
        ctx.save_for_backward(hidden, weight, next_ids, logsumexp, entropy if entropy_grad else None)
        ctx.temperature, ctx.chunk_size, ctx.entropy_grad, ctx.fused = temperature, chunk_size, entropy_grad, fused
        if entropy is not None and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, next_ids, logsumexp, entropy = ctx.saved_tensors
        if grad_logps is None:
            grad_logps = torch.zeros_like(logsumexp)
        with_entropy_grad = ctx.entropy_grad and grad_entropy is not None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulated over chunks in fp32 (bf16 compute would round every chunk's partial sum).
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            if ctx.fused is not None:
                grad_logits = ctx.fused.logits_grad(
                    F.linear(hidden[start:end], weight), next_ids[start:end], logsumexp[start:end],
                    grad_logps[start:end], ctx.temperature, entropy[start:end] if with_entropy_grad else None,
                    grad_entropy[start:end] if with_entropy_grad else None,
                ).to(hidden.dtype)
            else:
                grad_logits = _eager_logits_grad(ctx, hidden, weight, next_ids, logsumexp, entropy, grad_logps,
                                                 grad_entropy if with_entropy_grad else None, start, end)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                grad_weight.add_(grad_logits.t() @ hidden[start:end])
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    next_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 2048,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    fused: FusedChunkOps | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each next token [T] and, with `with_entropy`, the entropy [T] (with its gradient when
    `entropy_grad`), under softmax(hidden · weightᵀ / temperature), `chunk_size` tokens at a time; hidden
    [T, H], weight [V, H]. With `fused` each chunk's softmax work runs compiled."""
    return ChunkedTokenLogps.apply(hidden, weight, next_ids, temperature, chunk_size, with_entropy, entropy_grad, fused)


@dataclass
class _Request:
    next_ids: torch.Tensor
    temperature: float
    with_entropy: bool
    entropy_grad: bool


class TokenLogpsHead(nn.Module):
    """Stands in for a causal LM's `lm_head` (the same `weight` parameter under the same state-dict key,
    tied to the embedding if it was). Inside `predicting(next_ids, ...)` a forward returns, instead of
    logits [1, T, V], each token's next-token log-prob and entropy [1, T, 2] (chunked, see
    `chunked_token_logps`); outside it, ordinary logits.

    Computing inside the model's forward keeps FSDP2 in charge of the weight: it is gathered for the
    forward, and its gradient is reduced after backward, as for the linear head it replaces. With `fused`
    the chunks' softmax work is compiled (`FusedChunkOps`).
    """

    def __init__(self, lm_head: nn.Linear, chunk_size: int, fused: bool = False):
        super().__init__()
        if lm_head.bias is not None:
            raise ValueError("TokenLogpsHead replaces a bias-free lm_head")
        self.weight = lm_head.weight
        self.chunk_size = chunk_size
        self.fused = FusedChunkOps() if fused else None
        self._request: _Request | None = None

    @contextlib.contextmanager
    def predicting(self, next_ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = False):
        """Forwards in this context return [1, T, 2]: log p(next_ids[t]) and the entropy (0 without
        `with_entropy`; differentiable with `entropy_grad`) at each of the row's T positions; next_ids [T]."""
        self._request = _Request(next_ids, temperature, with_entropy, entropy_grad)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._request is None:
            return F.linear(hidden, self.weight)
        request = self._request
        flat = hidden.reshape(-1, hidden.shape[-1])
        logps, entropy = chunked_token_logps(
            flat, self.weight, request.next_ids, request.temperature, self.chunk_size, request.with_entropy,
            request.entropy_grad, self.fused,
        )
        if entropy is None:
            entropy = torch.zeros_like(logps)
        shape = hidden.shape[:-1]
        return torch.stack([logps.view(shape), entropy.view(shape)], dim=-1)  # a new tensor, not a view (FSDP2)


# Models that transform the head's output (soft-capping, scaling) cannot take log-probs from the head alone.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def install_logps_head(model: nn.Module, chunk_size: int, fused: bool = False) -> TokenLogpsHead | None:
    """Replace `model.lm_head` by a `TokenLogpsHead` (its softmax work compiled with `fused`); None (nothing
    changed) where the model has no bias-free linear `lm_head` or post-processes its logits (then the
    caller uses full logits)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    model.lm_head = TokenLogpsHead(head, chunk_size, fused)
    return model.lm_head
