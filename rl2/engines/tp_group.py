"""Tensor-parallel groups of the rollout engine: which ranks share one engine, and on which GPUs.

torchrun numbers ranks node by node (rank = node_rank × local_world_size + local_rank), so
`tp_size` consecutive ranks that divide a node sit on consecutive GPUs of one node. The first
rank of each group leads it: it owns the engine, whose TP rank i runs on GPU
`base_gpu_id + i`, the GPU of the group's i-th rank.
"""

import dataclasses
import os
from dataclasses import dataclass

import torch.distributed as dist

from rl2.distributed.process_group import rank, world_size


@dataclass(frozen=True)
class TPGroupLayout:
    """This rank's place among the engine groups."""

    tp_size: int
    group_index: int  # which engine
    ranks: tuple[int, ...]  # the global ranks sharing the engine, in TP-rank order
    tp_rank: int  # this rank's index in `ranks`
    base_gpu_id: int  # local GPU index of TP rank 0 (the leader's local rank)

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0


def plan_tp_group(rank: int, world_size: int, local_rank: int, local_world_size: int, tp_size: int) -> TPGroupLayout:
    """The engine group of `rank`; a clear error when `tp_size` does not fit the world or a node."""
    if tp_size < 1:
        raise ValueError(f"rollout.tp_size must be >= 1, got {tp_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    if world_size % tp_size != 0:
        raise ValueError(
            f"rollout.tp_size={tp_size} must divide the number of ranks (world size {world_size})"
        )
    if local_world_size % tp_size != 0:
        raise ValueError(
            f"rollout.tp_size={tp_size} must divide the GPUs per node ({local_world_size} ranks on this node, "
            f"torchrun --nproc_per_node): an engine's TP ranks must share one node"
        )
    if tp_size > 1 and (world_size % local_world_size != 0 or rank % local_world_size != local_rank):
        raise ValueError(
            f"rollout.tp_size={tp_size}: rank {rank} has local rank {local_rank} with {local_world_size} ranks per "
            f"node in a world of {world_size}: ranks are not numbered node by node as torchrun numbers them, so "
            f"engine groups cannot be placed on one node each"
        )
    group_index, tp_rank = divmod(rank, tp_size)
    ranks = tuple(range(group_index * tp_size, (group_index + 1) * tp_size))
    return TPGroupLayout(tp_size, group_index, ranks, tp_rank, base_gpu_id=local_rank - tp_rank)


def plan_this_rank(tp_size: int) -> TPGroupLayout:
    """`plan_tp_group` for this process, from torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE (one node
    when run without torchrun).

    Under split placement this rank's default group is its side's (the rollout ranks, numbered from 0)
    while LOCAL_RANK still names its GPU: the side is planned as a world of its own, on one node, its
    GPUs offset by where the side starts on the node."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank()))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))
    full_world = int(os.environ.get("WORLD_SIZE", world_size()))
    if world_size() == full_world:
        return plan_tp_group(rank(), world_size(), local_rank, local_world_size, tp_size)
    if full_world != local_world_size:
        raise ValueError("rollout.placement=split with rollout.engine=sglang runs on one node (the rollout ranks' "
                         f"engines on its last GPUs); this world has {full_world} ranks, {local_world_size} per node")
    offset = local_rank - rank()
    layout = plan_tp_group(rank(), world_size(), rank(), world_size(), tp_size)
    return dataclasses.replace(layout, base_gpu_id=layout.base_gpu_id + offset)


def all_tp_groups(world_size: int, tp_size: int) -> list[tuple[int, ...]]:
    """The ranks of every engine group, in group order."""
    return [tuple(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]


def new_tp_group(layout: TPGroupLayout, world_size: int) -> dist.ProcessGroup:
    """A gloo process group for this rank's engine group (CPU objects: prompts, outputs, payloads).

    Collective: every rank creates every group, in the same order, as `new_group` requires.
    """
    mine = None
    for ranks in all_tp_groups(world_size, layout.tp_size):
        group = dist.new_group(list(ranks), backend="gloo")
        if ranks == layout.ranks:
            mine = group
    if mine is None:
        raise ValueError(f"rank group {layout.ranks} is not among the groups of a world of {world_size} ranks")
    return mine
