"""Per-token losses and their weights on plain tensors: the policy losses (PPO's clipped surrogate,
GSPO, CISPO), PPO's clipped value loss, KL estimators, the next-token loss of SFT, and the loss weights
of a batch.

A per-sequence tensor is 1-D and aligned with the sequence's token ids, and `action_mask` is 1 on
tokens the policy generated, 0 on prompt and tool tokens.
"""

import torch
from torch import Tensor

from rl2.config import KL_ESTIMATORS, LOSS_AGGS, LOSS_LEVELS


def kl_penalty(logps: Tensor, ref_logps: Tensor, estimator: str, clamp: bool = False) -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi, differentiable w.r.t. `logps`.

    Estimators from J. Schulman, "Approximating KL divergence" (2020), with r = ref / pi:
    k1 = -log r (unbiased, high variance, can be negative), k2 = (log r)^2 / 2 (biased, low variance),
    k3 = r - 1 - log r (unbiased, low variance, always >= 0). With `clamp` k3 is verl's `low_var_kl`: log r
    clamped to +-20 and k3 to [-10, 10], so one token far from the reference cannot blow the loss up.
    """
    log_ratio = logps - ref_logps
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        if clamp:
            log_ratio = log_ratio.clamp(-20, 20)
            return (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-10, 10)
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def policy_loss(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, clip: float, clip_high: float | None = None,
    clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate loss per token (Schulman et al. 2017) and where clipping is active.

    The ratio is clipped to [1 - clip, 1 + clip_high]; `clip_high` defaults to `clip`, a larger one is
    DAPO's clip-higher (Yu et al. 2025). With `clip_c` (dual-clip PPO, Ye et al. 2020; verl's clip_ratio_c)
    a token with a negative advantage loses at most clip_c x |A|. Returns (per_token_loss, clipped), with
    clipped 1.0 where a clipped term wins, i.e. where clipping zeroes the gradient.
    """
    if clip_high is None:
        clip_high = clip
    ratio = torch.exp(logps - old_logps)
    surrogate = ratio * advantages
    clipped_surrogate = torch.clamp(ratio, 1 - clip, 1 + clip_high) * advantages
    loss = -torch.minimum(surrogate, clipped_surrogate)
    clipped = clipped_surrogate < surrogate
    if clip_c is not None:
        bound = -clip_c * advantages
        dual = (advantages < 0) & (bound < loss)
        loss = torch.where(dual, bound, loss)
        clipped = clipped | dual
    return loss, clipped.float()


def sequence_index(cu_seqlens: Tensor, length: int) -> Tensor:
    """The index of the packed sequence each of a row's `length` tokens belongs to."""
    positions = torch.arange(length, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)


def gspo_loss(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, cu_seqlens: Tensor, clip: float,
    clip_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """GSPO's loss per token (Zheng et al. 2025, eq. 5-7) for a packed row: each sequence's ratio
    s = exp(mean over its `mask`ed tokens of log pi - log pi_old), and on each of its tokens
    -min(s A, clip(s, 1 - clip, 1 + clip_high) A). Weighted per sequence (loss_level=sequence) with one
    advantage per sequence, the sum is the paper's objective, negated. Returns (loss, clipped) like
    `policy_loss`; `cu_seqlens` bounds the row's sequences ([1, T] or [T] tensors)."""
    if clip_high is None:
        clip_high = clip
    shape, logps = logps.shape, logps.reshape(-1)
    old_logps, advantages, mask = old_logps.reshape(-1), advantages.reshape(-1), mask.reshape(-1).to(logps.dtype)
    index = sequence_index(cu_seqlens, logps.shape[0])
    n_sequences = cu_seqlens.shape[0] - 1
    counts = torch.zeros(n_sequences, dtype=logps.dtype, device=logps.device).index_add(0, index, mask)
    log_ratio = torch.where(mask.bool(), logps - old_logps, torch.zeros_like(logps))
    totals = torch.zeros(n_sequences, dtype=logps.dtype, device=logps.device).index_add(0, index, log_ratio)
    ratio = (totals / counts.clamp(min=1)).exp()[index]
    surrogate = ratio * advantages
    clipped_surrogate = ratio.clamp(1 - clip, 1 + clip_high) * advantages
    loss = -torch.minimum(surrogate, clipped_surrogate)
    return loss.view(shape), (clipped_surrogate < surrogate).to(logps.dtype).view(shape)


def cispo_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, clip_high: float) -> tuple[Tensor, Tensor]:
    """CISPO's loss per token (MiniMax-M1, 2025, eq. 4): -sg(min(r, 1 + clip_high)) A log pi with r = pi / pi_old.
    The importance weight is clipped, not the token: every token keeps its gradient (PPO's clip zeroes the
    gradient of the tokens it clips); no lower bound, as in the paper. Returns (loss, clipped), clipped 1.0
    where the weight was cut."""
    ratio = (logps - old_logps).detach().exp()
    weight = ratio.clamp(max=1 + clip_high)
    return -weight * advantages * logps, (ratio > 1 + clip_high).to(logps.dtype)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """Clipped value loss per token (as in PPO implementations) and where the clipped term wins.

    The new values may move at most `clip` from the old ones before the loss stops improving:
    loss = 0.5 * max((V - R)^2, (V_clipped - R)^2). Returns (per_token_loss, clipped), with clipped
    1.0 where the clipped term is strictly larger.
    """
    # Clamped around the old values (not old + clamp(V - old)): inside the band the clipped value is V itself, to
    # the bit, so the clip fraction counts only tokens that were clipped.
    clipped_values = torch.clamp(values, old_values - clip, old_values + clip)
    error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(error, clipped_error)
    clipped = (clipped_error > error).float()
    return loss, clipped


def loss_weights(action_masks: list[Tensor], level: str, norm: float | None = None) -> list[Tensor]:
    """Per-token float32 weights such that the batch loss is sum over sequences of (weights * loss).sum().

    With B the batch's sequences (every completion, also one whose tokens all carry no loss: cut by overlong
    filtering, left out after an env error, rejected by the rollout correction), a sequence's k > 0 action
    tokens each weigh:
    - "token_mean" ("token"): 1 / (action tokens in the batch), DAPO's token-level mean (Yu et al. 2025);
    - "seq_mean_token_mean" ("sequence"): 1 / (k B), the mean of per-sequence means of GRPO's paper;
    - "seq_mean_token_sum": 1 / B, each sequence's token sum, averaged over sequences;
    - "seq_mean_token_sum_norm": 1 / (B norm), the token sums over a constant, Dr. GRPO's (Liu et al. 2025)
      normaliser (TRL's `dr_grpo`: / (batch size x max_completion_length)).
    The sequence means divide by B as verl's `agg_loss` and TRL's `grpo` / `dr_grpo` do: a sequence without
    loss tokens adds 0 to the sum and 1 to the count. Masked tokens weigh 0; all 0 if the batch has no
    action tokens. The token mean's weights sum to 1.
    """
    level = {"token": "token_mean", "sequence": "seq_mean_token_mean"}.get(level, level)
    if level not in LOSS_AGGS:
        raise ValueError(f"unknown loss aggregation {level!r}; expected one of {LOSS_LEVELS + LOSS_AGGS}")
    if level == "seq_mean_token_sum_norm" and not (norm and norm > 0):
        raise ValueError(f"seq_mean_token_sum_norm needs a positive constant (actor.loss_agg_norm), got {norm}")
    masks = [mask.bool().float() for mask in action_masks]
    counts = [int(mask.sum().item()) for mask in masks]
    if level == "token_mean":
        total = sum(counts)
        return [mask / total if total > 0 else mask for mask in masks]
    n_sequences = len(masks)
    if level == "seq_mean_token_mean":
        return [mask / (count * n_sequences) if count > 0 else mask for mask, count in zip(masks, counts)]
    divisor = n_sequences * (norm if level == "seq_mean_token_sum_norm" else 1.0)
    return [mask / divisor for mask in masks]


def loss_aggregation(config) -> str:
    """A model section's loss aggregation: `loss_agg`, else its `loss_level` (RL2's key) by name."""
    return config.loss_agg or {"token": "token_mean", "sequence": "seq_mean_token_mean"}[config.loss_level]


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where `mask` is 1; 0 when the mask is empty."""
    mask = mask.bool()
    # where, not multiply: a NaN or inf at a masked position must not leak into the mean.
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1)


def with_loss_weights(sequences: list[dict[str, Tensor]], level: str = "token",
                      norm: float | None = None) -> list[dict[str, Tensor]]:
    """`sequences` with their `loss_weight` (`loss_weights` of their loss masks at `level`) and their
    `metric_weight`: the same weights scaled to sum to 1, so a metric weighted by them (entropy, clip ratio)
    is a mean under the aggregation whatever its normaliser."""
    weights = loss_weights([seq["loss_mask"] for seq in sequences], level, norm)
    total = float(sum(weight.sum() for weight in weights))
    return [{**seq, "loss_weight": weight, "metric_weight": weight / total if total > 0 else weight}
            for seq, weight in zip(sequences, weights)]


def sft_loss(outputs: dict[str, Tensor], micro_batch: dict[str, Tensor]) -> tuple[Tensor, dict]:
    """Negative log-likelihood of the tokens, weighted by `loss_weight`."""
    return -(outputs["logps"] * micro_batch["loss_weight"]).sum(), {}
