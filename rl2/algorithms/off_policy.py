"""The gap between the policy that sampled a trajectory and the one an update starts from, measured
and corrected per sequence.

Each generated token has three log-probs: the behaviour policy's (the engine's, at sampling), the
proximal policy's (the actor's at the start of the step, `actor.recompute_logprobs`) and the current
one's (while the update runs). The engine and the trainer compute the same policy differently (other
kernels, another dtype), and a stale trajectory was sampled by older weights, so the behaviour and
proximal log-probs differ. With ratio rho = pi_prox / pi_behav per token (detached), a correction gives
each token an importance weight and may reject tokens or whole sequences:

- `tis` (Yao et al. 2025): w = min(rho, C); `seq_tis`: the sequence's product of ratios, truncated at C;
  `geo_tis`: their geometric mean (the length-normalised product), truncated at C;
- `mis` (masked IS, Liu, Li et al. 2025): w = rho where rho <= C, the token rejected above; `seq_mis` /
  `geo_mis`: the same with the product / geometric mean, rejecting the whole sequence;
- `icepop` (Ring-1T): tokens with rho outside [low, high] rejected, the others weighted by rho;
- `decoupled` (Hilton et al. 2021, as in AReaL): w = rho, untruncated; with PPO the clip is against the
  proximal policy already (the recomputed log-probs).

Log-ratios are clamped to +-20 before exponentiating (as verl does): a product over a long sequence
overflows otherwise. Rejected tokens leave the loss and its denominator by default (the loss weights are
made from the masks after rejection, as verl's rejection sampling does); verl's IcePop, TRL's `*_mask`
modes, slime and AReaL keep them in the denominator with weight 0, which shrinks every other token's step
by the share rejected: `actor.rejected_tokens=keep_in_denominator`.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

LOG_RATIO_LIMIT = 20.0
TOKEN_MODES = ("tis", "mis", "icepop", "decoupled")
SEQUENCE_MODES = ("seq_tis", "geo_tis", "seq_mis", "geo_mis")


@dataclass(frozen=True)
class Correction:
    """A rollout correction (`mode`, one of `rl2.config.CORRECTIONS`) and its thresholds: `threshold` C,
    and IcePop's band [`low`, `high`]."""

    mode: str = "none"
    threshold: float = 2.0
    low: float = 0.5
    high: float = 5.0


def rollout_correction(actor, rollout) -> Correction:
    """The correction the `actor` section's `rollout_correction` asks for: RL2's `actor.tis_coef` > 0 is token-level
    TIS at that threshold; `auto` is token-level TIS under partial rollout or `rollout.max_staleness` > 0 (tokens
    sampled by older weights; the `rollout` section) when the proximal log-probs are recomputed, else none."""
    if actor.tis_coef > 0:
        return Correction("tis", actor.tis_coef)
    mode = actor.rollout_correction
    if mode == "auto":
        stale = rollout.partial_rollout or rollout.max_staleness > 0
        mode = "tis" if stale and actor.recompute_logprobs else "none"
    return Correction(mode, actor.correction_threshold, actor.icepop_low, actor.icepop_high)


def log_ratios(proximal: Tensor, behaviour: Tensor, mask: Tensor) -> Tensor:
    """log(pi_prox / pi_behav) per token, clamped to +-LOG_RATIO_LIMIT, 0 off `mask`."""
    return torch.where(mask.bool(), proximal - behaviour, torch.zeros_like(proximal)).clamp(
        -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def correction_weights(proximal: Tensor, behaviour: Tensor, mask: Tensor, correction: Correction) -> tuple[Tensor, Tensor]:
    """(weights, keep) for one sequence's tokens (1-D): the importance weight that multiplies each token's
    loss (detached; 1 off `mask`), and the mask of its tokens that stay in the loss (`mask` less the
    rejected ones)."""
    mask = mask.bool()
    log_rho = log_ratios(proximal.detach(), behaviour, mask)
    mode, limit = correction.mode, correction.threshold
    ones = torch.ones_like(log_rho)
    if mode == "none":
        return ones, mask
    if mode in TOKEN_MODES:
        rho = log_rho.exp()
        keep = mask
        if mode == "tis":
            weights = rho.clamp(max=limit)
        elif mode == "mis":
            keep = mask & (rho <= limit)
            weights = rho
        elif mode == "icepop":
            keep = mask & (rho >= correction.low) & (rho <= correction.high)
            weights = rho
        else:  # decoupled
            weights = rho
    elif mode in SEQUENCE_MODES:
        total = log_rho.sum()
        level = total if mode.startswith("seq") else total / mask.sum().clamp(min=1)
        rho = level.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
        if mode.endswith("tis"):
            weights, keep = ones * rho.clamp(max=limit), mask
        else:
            weights, keep = ones * rho, mask & (rho <= limit)
    else:
        raise ValueError(f"unknown rollout correction {mode!r}")
    return torch.where(keep, weights, ones).detach(), keep


def mismatch_metrics(proximal: list[Tensor], behaviour: list[Tensor], masks: list[Tensor], threshold: float) -> dict[str, float]:
    """How far the behaviour policy is from the proximal one over a batch's generated tokens: KL(behav ||
    prox) by Schulman's k1 and k3 estimators (from samples of the behaviour policy, r = pi_prox / pi_behav:
    k1 = -log r, k3 = r - 1 - log r), the shares of tokens and of sequences whose ratio (a sequence's:
    the product of its tokens') leaves [1/C, C], and the largest token ratio."""
    masks = [mask.bool() for mask in masks]
    log_rho = [log_ratios(p, b, m) for p, b, m in zip(proximal, behaviour, masks)]
    tokens = torch.cat([lr[m] for lr, m in zip(log_rho, masks)]).double()
    if tokens.numel() == 0:
        return {}
    bound = float(torch.tensor(threshold, dtype=torch.float64).log())
    sequences = torch.stack([lr[m].double().sum() for lr, m in zip(log_rho, masks) if m.any()])
    return {
        "offpolicy/kl_k1": float((-tokens).mean()),
        "offpolicy/kl_k3": float((tokens.exp() - 1 - tokens).mean()),
        "offpolicy/token_ratio_outside": float((tokens.abs() > bound).double().mean()),
        "offpolicy/sequence_ratio_outside": float((sequences.abs() > bound).double().mean()),
        "offpolicy/max_ratio": float(tokens.max().exp()),
    }
