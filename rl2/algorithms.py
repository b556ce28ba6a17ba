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


def group_advantages(rewards: Tensor, group_size: int, norm_var: bool, eps: float = 1e-6) -> Tensor:
    """Each reward minus the mean of its group of `group_size` consecutive responses to one prompt.

    With `norm_var` (GRPO, Shao et al. 2024, "DeepSeekMath") the result is divided by the group's
    unbiased (Bessel-corrected, as `torch.std`) standard deviation + `eps`; without it this is the
    unnormalised baseline of Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training").
    A group of equal rewards, including a group of one response, gets advantage exactly 0.
    """
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    if group_size == 1:
        # Its own baseline; the unbiased std of one sample would be NaN.
        return torch.zeros_like(rewards)
    groups = rewards.reshape(-1, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if norm_var:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    # The mean of equal floats can be off by an ulp, which the std division would blow up to ~1e-2.
    uniform = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    advantages = advantages.masked_fill(uniform, 0.0)
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
