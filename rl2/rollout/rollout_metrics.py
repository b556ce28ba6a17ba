"""Statistics of a rollout: rewards, lengths, turns and errors; avg@k and pass@k on a test set.

A rollout in which no `reward_fn` call succeeded has no reward statistics at all (not 0.0): its
metrics say how many calls failed (`reward_errors`), and `unscored_report` says why.
"""

import torch

from rl2.rollout.env_file import shorten
from rl2.rollout.trajectory import Trajectory


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Reward, length, turn and error statistics of a rollout; rewards of scored trajectories only
    (`reward/mean` and `reward/std` are absent when none was scored)."""
    scored = [t.reward for t in trajectories if t.reward is not None]
    rewards = torch.tensor(scored, dtype=torch.float64)
    lengths = torch.tensor([t.response_length for t in trajectories], dtype=torch.float64)
    reward_stats = {}
    if scored:
        reward_stats = {"reward/mean": rewards.mean().item(),
                        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0}
    return {
        **reward_stats,
        "reward_errors": float(len(trajectories) - len(scored)),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "turns/mean": sum(t.turns for t in trajectories) / len(trajectories),
        "truncated_ratio": sum(t.truncated for t in trajectories) / len(trajectories),
        "env_errors": float(sum(len(t.errors) for t in trajectories)),
        "excluded": float(sum(t.excluded for t in trajectories)),
        "trajectories": float(len(trajectories)),
        **tool_metrics(trajectories),
        **agent_metrics(trajectories),
    }


def agent_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """An agent file's rollout (`rollout.agent_path`): `agent/requests` and `agent/sequences` per trajectory,
    `agent/reused_tokens` (prompt tokens taken from sampled sequences) and `agent/rendered_tokens` (rendered
    by the chat template) in all, `agent/drift_requests` (requests that re-encoded earlier assistant turns),
    `agent/at_request_limit` (the fraction whose agent was refused a request past rollout.max_turns),
    `agent/ignored/<field>`: requests whose sampling fields were ignored, and `agent/extra/<name>`: the mean of
    each number `run` returned beside its reward."""
    stats = [t.agent_stats for t in trajectories if t.agent_stats]
    if not stats:
        return {}
    metrics = {
        "agent/requests": sum(s["requests"] for s in stats) / len(stats),
        "agent/sequences": sum(s["sequences"] for s in stats) / len(stats),
        "agent/reused_tokens": float(sum(s["reused_tokens"] for s in stats)),
        "agent/rendered_tokens": float(sum(s["rendered_tokens"] for s in stats)),
        "agent/drift_requests": float(sum(s["drift_requests"] for s in stats)),
        "agent/at_request_limit": sum(bool(s.get("at_request_limit")) for s in stats) / len(stats),
    }
    extras: dict[str, list[float]] = {}
    for s in stats:
        for name, count in s.get("ignored_fields", {}).items():
            metrics[f"agent/ignored/{name}"] = metrics.get(f"agent/ignored/{name}", 0.0) + count
        for name, value in s.get("extras", {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                extras.setdefault(name, []).append(float(value))
    metrics.update({f"agent/extra/{name}": sum(values) / len(values) for name, values in extras.items()})
    return metrics


def tool_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """`tools/<name>/calls`, `tools/<name>/errors` (calls the model got wrong: unknown tool, bad arguments,
    the tool raised or timed out) and `tools/<name>/latency` (mean seconds of the calls that ran), per
    tool the rollout called; calls of tools that do not exist count under `(unknown)`."""
    by_name: dict[str, list[dict]] = {}
    for trajectory in trajectories:
        for call in trajectory.tool_stats:
            by_name.setdefault(call["name"] or "(unknown)", []).append(call)
    metrics = {}
    for name, calls in sorted(by_name.items()):
        ran = [call["seconds"] for call in calls if call["seconds"] > 0]
        metrics[f"tools/{name}/calls"] = float(len(calls))
        metrics[f"tools/{name}/errors"] = float(sum(call["error"] for call in calls))
        if ran:
            metrics[f"tools/{name}/latency"] = sum(ran) / len(ran)
    return metrics


def correct_by_prompt(trajectories: list[Trajectory], k: int) -> torch.Tensor:
    """[prompts, k] floats: 1.0 where a prompt's trajectory (of `k` consecutive ones) scored above 0,
    0.0 where it scored 0 or less, NaN where it could not be scored (excluded: an env error)."""
    return torch.tensor(
        [float("nan") if t.excluded else float(t.reward > 0) for t in trajectories], dtype=torch.float64
    ).view(-1, k)


def eval_metrics(trajectories: list[Trajectory], k: int) -> dict[str, float]:
    """Mean reward, avg@k (the mean share of correct responses, reward > 0) and pass@k (the share of
    prompts with a correct one) of `k` consecutive trajectories per prompt, the mean reward per source
    where the rows name theirs (`test/<data_source>/reward_mean`), and how many test rewards failed
    (`test/reward_errors`). Answers that could not be scored (env errors) count neither as
    right nor as wrong; when none could be, the reward statistics are absent."""
    correct = correct_by_prompt(trajectories, k)
    scored = ~correct.isnan()
    rewards = [t.reward for t in trajectories if t.reward is not None]
    reward_stats = {}
    if scored.any():
        reward_stats[f"test/avg@{k}"] = correct[scored].mean().item()
        reward_stats[f"test/pass@{k}"] = (correct.nan_to_num(0.0) > 0).any(dim=1)[scored.any(dim=1)].float().mean().item()
    if rewards:
        reward_stats["test/reward_mean"] = sum(rewards) / len(rewards)
    reward_stats.update(source_reward_means(trajectories))
    return {
        **reward_stats,
        "test/reward_errors": float(len(trajectories) - len(rewards)),
        "test/response_length": sum(t.response_length for t in trajectories) / len(trajectories),
        "test/env_errors": float(sum(len(t.errors) for t in trajectories)),
    }


def source_reward_means(trajectories: list[Trajectory]) -> dict[str, float]:
    """`test/<source>/reward_mean` for each source (`Trajectory.source`, a row's `data_source`) with a
    scored trajectory; nothing when no trajectory has a source."""
    by_source: dict[str, list[float]] = {}
    for t in trajectories:
        if t.source is not None and t.reward is not None:
            by_source.setdefault(t.source, []).append(t.reward)
    return {f"test/{source}/reward_mean": sum(rewards) / len(rewards) for source, rewards in sorted(by_source.items())}


def unscored_report(trajectories: list[Trajectory], env_path: str) -> str | None:
    """None when some trajectory was scored; else what failed: the env file, how many trajectories,
    the first error and its sample."""
    if not trajectories or any(t.reward is not None for t in trajectories):
        return None
    first = next((t for t in trajectories if t.errors), trajectories[0])
    error = first.errors[-1] if first.errors else "no reward"
    last = first.messages[-1].get("content", "") if first.messages else ""
    return (f"no trajectory could be scored with env file {env_path} ({len(trajectories)} of {len(trajectories)} "
            f"unscored: reward_fn, the environment or the agent failed); first error: {error}; its sample: "
            f"answer={shorten(repr(first.answer))}, last message {shorten(repr(last))}")
