"""new_tp_group for real: every rank checks the members of its rollout engine group.

Usage: torchrun --nproc_per_node=N tests/workers/tp_group_check.py OUT_JSON

For tp_size 2 (when it divides the node) and 1, each rank plans its layout from the torchrun
environment, creates the groups with `new_tp_group`, and all-gathers (global rank, TP rank)
over the group it got back: the members must be exactly `layout.ranks`, in TP-rank order, and
the group rank must be the TP rank. A failed check raises, so the rank exits non-zero. Rank 0
writes what every rank saw as JSON.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from rl2.distributed.process_group import exit_process, init_distributed
from rl2.engines.tp_group import all_tp_groups, new_tp_group, plan_this_rank, plan_tp_group


def check(tp_size: int) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    assert (rank, world) == (dist.get_rank(), dist.get_world_size()), (rank, world)
    layout = plan_tp_group(rank, world, local_rank, local_world, tp_size)
    assert plan_this_rank(tp_size) == layout, (plan_this_rank(tp_size), layout)
    assert layout.ranks == all_tp_groups(world, tp_size)[layout.group_index], layout
    assert layout.ranks[layout.tp_rank] == rank, layout
    assert layout.base_gpu_id + layout.tp_rank == local_rank, layout

    group = new_tp_group(layout, world)
    assert group is not None, f"rank {rank}: no group returned for {layout}"
    assert dist.get_world_size(group) == tp_size, (dist.get_world_size(group), tp_size)
    assert dist.get_rank(group) == layout.tp_rank, (dist.get_rank(group), layout)
    assert tuple(dist.get_process_group_ranks(group)) == layout.ranks, dist.get_process_group_ranks(group)

    members: list = [None] * tp_size
    dist.all_gather_object(members, (rank, layout.tp_rank, layout.leader), group=group)
    expected = [(member, i, layout.leader) for i, member in enumerate(layout.ranks)]
    assert members == expected, f"rank {rank} tp {tp_size}: gathered {members}, expected {expected}"

    # A tensor collective over the group sums only its members.
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=group)
    assert total.item() == float(sum(layout.ranks)), (total.item(), layout.ranks)
    return {"layout": [layout.group_index, list(layout.ranks), layout.tp_rank, layout.base_gpu_id],
            "members": [list(m) for m in members], "sum": total.item()}


def main() -> None:
    out_file = sys.argv[1]
    init_distributed(timeout_minutes=1)
    local_world = int(os.environ["LOCAL_WORLD_SIZE"])
    seen = {}
    for tp_size in (2, 1):
        if local_world % tp_size == 0:
            seen[f"tp{tp_size}"] = check(tp_size)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() == 0:
        with open(out_file, "w") as f:
            json.dump(everyone, f)


if __name__ == "__main__":
    main()
    exit_process(0)  # gloo can abort a finished rank during interpreter teardown (see its docstring)
