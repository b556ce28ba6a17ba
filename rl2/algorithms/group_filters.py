"""Which groups of trajectories a step trains on: DAPO's dynamic filtering and GRPO-RoC's
down-sampling of oversampled groups, over trajectories with a `reward` and an `excluded` flag
(an env error or an aborted generation: no loss, and not a candidate)."""

from collections.abc import Sequence

import torch

from rl2.algorithms.advantages import uniform_groups
from rl2.algorithms.resample_on_correct import resample_on_correct


def groups_with_signal(trajectories: Sequence, group_size: int) -> tuple[list, float]:
    """The trajectories of the groups with advantage signal, at least two that can train and not all
    their rewards equal; and the ratio of groups dropped. With one response per prompt there are no
    groups to compare within (the baseline is the batch's): nothing is dropped, as in RL2, which
    filters only groups of more than one response."""
    if group_size == 1:
        return list(trajectories), 0.0
    groups = [trajectories[start : start + group_size] for start in range(0, len(trajectories), group_size)]

    def has_signal(group: Sequence) -> bool:
        rewards = [t.reward for t in group if not t.excluded]
        return len(rewards) > 1 and not uniform_groups(rewards, len(rewards))

    kept_groups = [group for group in groups if has_signal(group)]
    dropped = len(groups) - len(kept_groups)
    return [t for group in kept_groups for t in group], dropped / max(len(groups), 1)


def resample_groups(
    trajectories: Sequence,
    penalties: Sequence[float],
    group_size: int,
    keep: int,
    mode: str,
    min_each: int,
    generator: torch.Generator,
) -> tuple[list, int]:
    """GRPO-RoC: each group of `group_size` cut to `keep` trajectories (`resample_on_correct`, with
    the `penalties` of its positives), in order; groups of equal rewards are dropped. Returns the
    kept trajectories and the number of groups dropped. With fewer usable trajectories than `keep`,
    excluded ones fill the group (they carry no loss)."""
    kept, dropped = [], 0
    for start in range(0, len(trajectories), group_size):
        group = trajectories[start : start + group_size]
        usable = [j for j, t in enumerate(group) if not t.excluded]
        chosen = resample_on_correct(
            [group[j].reward for j in usable], [penalties[start + j] for j in usable], keep, mode, min_each, generator
        )
        if not chosen:
            dropped += 1
            continue
        chosen = [usable[j] for j in chosen]
        chosen += [j for j in range(len(group)) if group[j].excluded][: keep - len(chosen)]
        kept += [group[j] for j in sorted(chosen)]
    return kept, dropped
