"""Advantages on plain tensors: GAE (PPO), group baselines (GRPO, Dr. GRPO) and batch baselines (REINFORCE).

A per-sequence tensor is 1-D and aligned with the sequence's token ids, and `action_mask` is 1 on
tokens the policy generated, 0 on prompt and tool tokens.
"""

from collections.abc import Sequence

import torch
from torch import Tensor


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


def leave_one_out_advantages(rewards: Tensor, group_size: int, valid: Tensor | None = None) -> Tensor:
    """RLOO's advantages: each valid reward minus the mean of the other valid rewards of its group of
    `group_size`; 0 for invalid ones and in groups with fewer than two valid members."""
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    groups, members = rewards.reshape(-1, group_size), valid.reshape(-1, group_size)
    count = members.sum(dim=1, keepdim=True)
    total = torch.where(members, groups, torch.zeros_like(groups)).sum(dim=1, keepdim=True)
    others = (total - groups) / (count - 1).clamp(min=1)
    advantages = torch.where(members & (count > 1), groups - others, torch.zeros_like(groups))
    return advantages.reshape(rewards.shape)


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, action_mask: Tensor, gamma: float) -> Tensor:
    """Per action token the discounted sum of the token rewards from it on (action tokens only are steps);
    0 elsewhere."""
    returns = torch.zeros_like(token_rewards)
    running = 0.0
    for t in reversed(torch.nonzero(action_mask.bool()).flatten().tolist()):
        running = float(token_rewards[t]) + gamma * running
        returns[t] = running
    return returns


def turn_discounts(turn_starts: Tensor, discount: float) -> Tensor:
    """Per token of a trajectory of several sequences (`turn_starts`: 1.0 where a sequence begins), the
    factor `discount ** (K - 1 - k)` of the k-th of its K sequences: the last sequence 1, each earlier one
    a further `discount` (a reward that comes at the end reaches earlier turns discounted)."""
    index = turn_starts.cumsum(0)
    return discount ** (index[-1] - index) if len(index) else torch.ones_like(turn_starts)


def trajectory_advantages(
    rewards: Tensor,
    valid: Tensor,
    masks: list[Tensor],
    estimator: str,
    group_size: int,
    norm_var: bool = False,
    global_norm: bool = False,
    gamma: float = 1.0,
    lamda: float = 1.0,
    kl: list[Tensor] | None = None,
    kl_coef: float = 0.0,
    values: list[Tensor] | None = None,
    std_eps: float = 1e-6,
    dense_rewards: list[Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """Per-token advantages of a batch of trajectories (and GAE's returns, else None).

    `rewards` [n] are the trajectories' scores (0 where not `valid`), `masks` their loss masks, `kl`
    (when given) the per-token KL to the reference that is subtracted from the reward, times `kl_coef`;
    `dense_rewards` (when given) per-token rewards (e.g. on-policy distillation's) that are added to it the
    same way: summed into the score by the baseline estimators, per token with reinforce_plus_plus and gae.
    estimator="reinforce": one advantage per trajectory, its score (reward minus the KL summed over
    its tokens) minus a baseline, on every action token:
    - by default the baseline is the mean of its group of `group_size` responses to one prompt and,
      with `norm_var`, the result is divided by the group's std (`group_advantages`);
    - with `global_norm`, or with one response per prompt (`group_size` 1), the whole batch is one
      group: the baseline is the mean score of the batch's valid trajectories and, with `norm_var`,
      the divisor is their unbiased std (+ eps). Without `norm_var` nothing is divided, so
      `global_norm` alone still swaps the group mean for the batch mean. This is RL2's
      `_compute_reinforce_adv` (RL2/utils/algorithms.py): `if responses_per_prompt == 1 or
      global_norm: baseline = rewards.mean(); std = rewards.std()`, else the same per group, then
      `advantages = rewards - baseline` and, `if norm_var`, `advantages /= std + eps`; RL2 computes
      it once over the whole step's batch, as here (every rank holds all trajectories).
    Invalid trajectories get advantage 0 and count in no mean or std. `std_eps` is added to the std.
    estimator="rloo" (Ahmadian et al. 2024): the score minus the mean of the *other* valid responses of its
    group, G/(G-1) (score - group mean), as verl's `compute_rloo_outcome_advantage`.
    estimator="reinforce_plus_plus_baseline" (Hu et al. 2025; verl's): the score minus its group's mean, then
    whitened over the batch's action tokens.
    estimator="reinforce_plus_plus" (Hu et al. 2025): per action token the discounted return of the token
    rewards (the score's reward on the last action token, the KL penalty on each when given; `gamma`), then
    whitened over the batch's action tokens. Only action tokens are time steps (a tool's tokens are skipped,
    as in `gae`; verl's resets the return at every masked token).
    estimator="gae": the reward lands on the last action token, the KL on every token, and GAE runs
    against the critic's `values`; the advantages are then whitened over the batch's action tokens (minus
    their mean, over their unbiased std + float eps; the returns are not), as RL2's `_compute_gae` and verl's
    `masked_whiten` do.
    """
    if estimator in ("reinforce", "rloo", "reinforce_plus_plus_baseline"):
        scores = rewards.clone()
        if kl is not None:
            scores -= kl_coef * torch.stack([(k * m).sum() for k, m in zip(kl, masks)])
        if dense_rewards is not None:
            scores += torch.stack([(r * m).sum() for r, m in zip(dense_rewards, masks)])
        batch_baseline = global_norm or group_size == 1
        size = max(len(scores), 1) if batch_baseline else group_size
        if estimator == "rloo":
            advantages = leave_one_out_advantages(scores, size, valid)
        else:
            advantages = group_advantages(scores, size, norm_var and estimator == "reinforce", valid, std_eps)
        per_token = [a * m for a, m in zip(advantages, masks)]
        return (whiten(per_token, masks, verl=True) if estimator == "reinforce_plus_plus_baseline" else per_token), None
    if estimator == "reinforce_plus_plus":
        per_token = []
        for i, mask in enumerate(masks):
            token_rewards = -kl_coef * kl[i] * mask if kl is not None else torch.zeros_like(mask)
            if dense_rewards is not None:
                token_rewards = token_rewards + dense_rewards[i] * mask
            if mask.any() and valid[i]:
                token_rewards[int(mask.nonzero().max())] += rewards[i]
            per_token.append(discounted_returns(token_rewards, mask, gamma) * valid[i])
        return whiten(per_token, masks, verl=True), None
    if values is None:
        raise ValueError("estimator='gae' needs the critic's values")
    per_token, returns = [], []
    for i, mask in enumerate(masks):
        token_rewards = -kl_coef * kl[i] * mask if kl is not None else torch.zeros_like(mask)
        if dense_rewards is not None:
            token_rewards = token_rewards + dense_rewards[i] * mask
        last_action = int(mask.nonzero().max()) if mask.any() else len(mask) - 1
        token_rewards[last_action] += rewards[i]
        advantage, ret = gae(token_rewards, values[i], mask, gamma, lamda)
        per_token.append(advantage)
        returns.append(ret)
    return whiten(per_token, masks), returns


def whiten(advantages: list[Tensor], masks: list[Tensor], verl: bool = False) -> list[Tensor]:
    """(advantage - mean) / (std + eps) over every masked token of the batch (unbiased std, eps the dtype's
    machine epsilon, as RL2's `_compute_gae`), or with `verl` (advantage - mean) / sqrt(var + 1e-8) (verl's
    `masked_whiten`); 0 off the masks; unchanged with fewer than two tokens."""
    kept = torch.cat([a[m.bool()] for a, m in zip(advantages, masks)]) if advantages else torch.zeros(0)
    if kept.numel() < 2:
        return advantages
    mean = kept.mean()
    scale = torch.rsqrt(kept.var() + 1e-8) if verl else 1 / (kept.std() + torch.finfo(kept.dtype).eps)
    return [(a - mean) * m * scale for a, m in zip(advantages, masks)]
