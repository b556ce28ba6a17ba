"""Statistics of a rollout: rewards, lengths, turns and errors; avg@k and pass@k on a test set."""

import torch

from rl2.rollout.trajectory import Trajectory


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Reward, length, turn and error statistics of a rollout; rewards of scored trajectories only."""
    scored = [t.reward for t in trajectories if t.reward is not None]
    rewards = torch.tensor(scored or [0.0], dtype=torch.float64)
    lengths = torch.tensor([t.response_length for t in trajectories], dtype=torch.float64)
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "turns/mean": sum(t.turns for t in trajectories) / len(trajectories),
        "truncated_ratio": sum(t.truncated for t in trajectories) / len(trajectories),
        "env_errors": float(sum(len(t.errors) for t in trajectories)),
        "excluded": float(sum(t.excluded for t in trajectories)),
        "trajectories": float(len(trajectories)),
    }


def correct_by_prompt(trajectories: list[Trajectory], k: int) -> torch.Tensor:
    """[prompts, k] floats: 1.0 where a prompt's trajectory (of `k` consecutive ones) scored above 0,
    0.0 where it scored 0 or less, NaN where it could not be scored (excluded: an env error)."""
    return torch.tensor(
        [float("nan") if t.excluded else float(t.reward > 0) for t in trajectories], dtype=torch.float64
    ).view(-1, k)


def eval_metrics(trajectories: list[Trajectory], k: int) -> dict[str, float]:
    """Mean reward, avg@k (the mean share of correct responses, reward > 0) and pass@k (the share of
    prompts with a correct one) of `k` consecutive trajectories per prompt. Answers that could not
    be scored (env errors) count neither as right nor as wrong."""
    correct = correct_by_prompt(trajectories, k)
    scored = ~correct.isnan()
    rewards = [t.reward for t in trajectories if t.reward is not None]
    return {
        "test/reward_mean": sum(rewards) / max(len(rewards), 1),
        f"test/avg@{k}": correct[scored].mean().item() if scored.any() else 0.0,
        f"test/pass@{k}": (correct.nan_to_num(0.0) > 0).any(dim=1)[scored.any(dim=1)].float().mean().item()
        if scored.any() else 0.0,
        "test/response_length": sum(t.response_length for t in trajectories) / len(trajectories),
        "test/env_errors": float(sum(len(t.errors) for t in trajectories)),
    }
