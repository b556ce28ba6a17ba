"""RL maths on plain tensors: KL estimators, advantages (GAE, group baselines), PPO losses, loss weights.

Every function here is pure torch on one process; the trainer gathers what it needs before calling.
A per-sequence tensor is 1-D and aligned with the sequence's token ids, and `action_mask` is 1 on
tokens the policy generated, 0 on prompt and tool tokens.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_LEVELS = ("token", "sequence")


def kl_penalty(logps: Tensor, ref_logps: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi, differentiable w.r.t. `logps`.

    Estimators from J. Schulman, "Approximating KL divergence" (2020), with r = ref / pi:
    k1 = -log r (unbiased, high variance, can be negative), k2 = (log r)^2 / 2 (biased, low variance),
    k3 = r - 1 - log r (unbiased, low variance, always >= 0).
    """
    log_ratio = logps - ref_logps
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, action_mask: Tensor, gamma: float, lamda: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over one sequence.

    Only action tokens are time steps: prompt and tool tokens are skipped, so the value of the next
    action token bootstraps the previous one across a tool output, and the episode ends (next value
    0) after the last action token. Returns (advantages, returns), 0 at masked positions, with
    returns = advantages + values at action positions.
    """
    advantages = torch.zeros_like(rewards, dtype=values.dtype)
    returns = torch.zeros_like(rewards, dtype=values.dtype)
    positions = torch.nonzero(action_mask.bool()).flatten()
    if positions.numel() == 0:
        return advantages, returns

    # Python floats: element-wise tensor indexing in this loop would be far slower on long sequences.
    step_rewards = rewards[positions].tolist()
    step_values = values[positions].tolist()
    step_advantages = [0.0] * len(positions)
    next_value, next_advantage = 0.0, 0.0
    for i in reversed(range(len(positions))):
        # delta_t = r_t + gamma V(s_{t+1}) - V(s_t);  A_t = delta_t + gamma lamda A_{t+1}
        delta = step_rewards[i] + gamma * next_value - step_values[i]
        next_advantage = delta + gamma * lamda * next_advantage
        step_advantages[i] = next_advantage
        next_value = step_values[i]

    advantages[positions] = torch.tensor(step_advantages, dtype=values.dtype, device=values.device)
    returns[positions] = advantages[positions] + values[positions]
    return advantages, returns


def group_advantages(
    rewards: Tensor, group_size: int, norm_var: bool, valid: Tensor | None = None, eps: float = 1e-6
) -> Tensor:
    """Each reward minus the mean of its group of `group_size` consecutive responses to one prompt.

    With `norm_var` (GRPO, Shao et al. 2024, "DeepSeekMath") the result is divided by the group's
    unbiased (Bessel-corrected, as `torch.std`) standard deviation + `eps`; without it this is the
    unnormalised baseline of Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training").
    `valid` (bool, like `rewards`) leaves responses out: the group's statistics come from its valid
    members only, and an invalid response gets advantage 0. A group with fewer than two valid
    responses, or whose valid rewards are all equal, gets advantage exactly 0.
    """
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    groups = rewards.reshape(-1, group_size)
    members = valid.reshape(-1, group_size)
    count = members.sum(dim=1, keepdim=True)
    values = torch.where(members, groups, torch.zeros_like(groups))
    mean = values.sum(dim=1, keepdim=True) / count.clamp(min=1)
    advantages = groups - mean
    if norm_var:
        squares = torch.where(members, advantages**2, torch.zeros_like(groups)).sum(dim=1, keepdim=True)
        advantages = advantages / ((squares / (count - 1).clamp(min=1)).sqrt() + eps)
    # Equal rewards give exactly 0 (their mean can be off by an ulp, which the std division would
    # blow up to ~1e-2); so do groups of one (their own baseline; an unbiased std of one is NaN).
    highest = torch.where(members, groups, torch.full_like(groups, -torch.inf)).amax(dim=1, keepdim=True)
    lowest = torch.where(members, groups, torch.full_like(groups, torch.inf)).amin(dim=1, keepdim=True)
    no_signal = (count < 2) | (highest == lowest)
    advantages = advantages.masked_fill(no_signal | ~members, 0.0)
    return advantages.reshape(rewards.shape)


def policy_loss(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, clip: float, clip_high: float | None = None
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate loss per token (Schulman et al. 2017) and where clipping is active.

    The ratio is clipped to [1 - clip, 1 + clip_high]; `clip_high` defaults to `clip`, a larger one is
    DAPO's clip-higher (Yu et al. 2025). Returns (per_token_loss, clipped), with clipped 1.0 where
    the clipped term is strictly smaller, i.e. where clipping zeroes the gradient.
    """
    if clip_high is None:
        clip_high = clip
    ratio = torch.exp(logps - old_logps)
    surrogate = ratio * advantages
    clipped_surrogate = torch.clamp(ratio, 1 - clip, 1 + clip_high) * advantages
    loss = -torch.minimum(surrogate, clipped_surrogate)
    clipped = (clipped_surrogate < surrogate).float()
    return loss, clipped


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """Clipped value loss per token (as in PPO implementations) and where the clipped term wins.

    The new values may move at most `clip` from the old ones before the loss stops improving:
    loss = 0.5 * max((V - R)^2, (V_clipped - R)^2). Returns (per_token_loss, clipped), with clipped
    1.0 where the clipped term is strictly larger.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * torch.maximum(error, clipped_error)
    clipped = (clipped_error > error).float()
    return loss, clipped


def loss_weights(action_masks: list[Tensor], level: str) -> list[Tensor]:
    """Per-token float32 weights such that the batch loss is sum over sequences of (weights * loss).sum().

    level="token": every action token weighs 1 / (action tokens in the batch), the token-level mean
    of DAPO (Yu et al. 2025) and Dr. GRPO (Liu et al. 2025). level="sequence": a sequence with k > 0
    action tokens gives each 1 / (k * sequences with action tokens), the mean of per-sequence means
    of the original GRPO. Masked tokens weigh 0; the weights sum to 1, or are all 0 if the batch has
    no action tokens.
    """
    if level not in LOSS_LEVELS:
        raise ValueError(f"unknown loss level {level!r}; expected one of {LOSS_LEVELS}")
    masks = [mask.bool().float() for mask in action_masks]
    counts = [int(mask.sum().item()) for mask in masks]
    if level == "token":
        total = sum(counts)
        return [mask / total if total > 0 else mask for mask in masks]
    n_sequences = sum(count > 0 for count in counts)
    return [mask / (count * n_sequences) if count > 0 else mask for mask, count in zip(masks, counts)]


def uniform_groups(rewards: Sequence[float], group_size: int) -> list[int]:
    """Indices of groups of `group_size` consecutive rewards that are all equal (within 1e-9).

    Their group advantage is zero, so DAPO's dynamic sampling (Yu et al. 2025) drops them.
    """
    if group_size < 1 or len(rewards) % group_size != 0:
        raise ValueError(f"{len(rewards)} rewards cannot be split into groups of {group_size}")
    uniform = []
    for g in range(len(rewards) // group_size):
        group = rewards[g * group_size : (g + 1) * group_size]
        if max(group) - min(group) <= 1e-9:
            uniform.append(g)
    return uniform


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where `mask` is 1; 0 when the mask is empty."""
    mask = mask.bool()
    # where, not multiply: a NaN or inf at a masked position must not leak into the mean.
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1)


# ---------------------------------------------------------------------------------------------
# GRPO-RoC (rStar2-Agent, Shang et al. 2025): Resample-on-Correct down-sampling of oversampled groups

ROC_MODES = ("sample", "topk")
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
    Negatives are drawn uniformly without replacement. Positives are chosen by penalty (`rl2.roc_penalty`,
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
