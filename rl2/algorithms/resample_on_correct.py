"""GRPO-RoC (rStar2-Agent, Shang et al. 2025): Resample-on-Correct down-sampling of oversampled groups."""

import torch

from rl2.config import ROC_MODES

# In mode "sample" a positive weighs 1 / (penalty + ROC_EPS): a zero penalty gets a large finite weight
# (1e6, so it is drawn before any penalised one almost surely) and equal penalties give uniform draws.
ROC_EPS = 1e-6


def resample_on_correct(
    rewards: list[float],
    penalties: list[float],
    keep: int,
    mode: str = "sample",
    min_each: int = 2,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Indices (ascending) of the trajectories of one oversampled group that GRPO-RoC trains on.

    Resample-on-Correct (rStar2-Agent, Shang et al. 2025) cuts a group of rollouts of one prompt to
    `keep`. A group of equal rewards (within 1e-9, as `uniform_groups`) has no signal and gives `[]`;
    otherwise, with `keep` >= the group size, everything. Positives (reward > 0) and negatives
    (reward <= 0) keep the group's proportion: k_pos = floor(n_pos * keep / n + 1/2) (round half up,
    computed exactly in integers; not Python's half-to-even `round`), then moved into the range where
    each side keeps min(min_each, its size) and neither keeps more than it has; k_neg = keep - k_pos.
    Negatives are drawn uniformly without replacement. Positives are chosen by penalty (`rl2.tools.roc_penalty`,
    lower is better): mode "sample" (the paper) draws them one by one without replacement with
    probability proportional to 1 / (penalty + ROC_EPS); mode "topk" (the released code) takes the
    lowest penalties, ties to the lower index. Randomness comes from `generator` (torch's default
    generator when None).
    """
    n = len(rewards)
    if len(penalties) != n:
        raise ValueError(f"{n} rewards but {len(penalties)} penalties")
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    if mode not in ROC_MODES:
        raise ValueError(f"unknown resample-on-correct mode {mode!r}; expected one of {ROC_MODES}")
    if min_each < 0 or 2 * min_each > keep:
        raise ValueError(f"min_each must be between 0 and keep / 2 = {keep / 2:g}, got {min_each}")
    if any(not penalty >= 0 for penalty in penalties):  # `not >=` also rejects NaN
        raise ValueError(f"penalties must be non-negative numbers, got {list(penalties)}")
    if n == 0 or max(rewards) - min(rewards) <= 1e-9:
        return []
    if keep >= n:
        return list(range(n))

    positives = [i for i in range(n) if rewards[i] > 0]
    negatives = [i for i in range(n) if not rewards[i] > 0]
    n_pos, n_neg = len(positives), len(negatives)
    k_pos = (2 * n_pos * keep + n) // (2 * n)  # floor(n_pos * keep / n + 1/2), exactly
    lowest = max(min(min_each, n_pos), keep - n_neg)
    highest = min(n_pos, keep - min(min_each, n_neg))
    k_pos = min(max(k_pos, lowest), highest)  # lowest <= highest as keep < n and keep >= 2 * min_each
    k_neg = keep - k_pos

    if k_pos == 0:
        kept_pos = []
    elif mode == "topk":
        kept_pos = sorted(positives, key=lambda i: (penalties[i], i))[:k_pos]
    else:
        weights = torch.tensor([1.0 / (penalties[i] + ROC_EPS) for i in positives], dtype=torch.float64)
        drawn = torch.multinomial(weights, k_pos, replacement=False, generator=generator)
        kept_pos = [positives[j] for j in drawn.tolist()]
    drawn = torch.randperm(n_neg, generator=generator)[:k_neg]
    kept_neg = [negatives[j] for j in drawn.tolist()]
    return sorted(kept_pos + kept_neg)
