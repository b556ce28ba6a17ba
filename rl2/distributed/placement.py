"""Split placement: one torchrun world divided into ranks that train and ranks that only generate.

The first `world - rollout_ranks` ranks train, the last `rollout_ranks` generate. Each side gets a default
process group of its own (a trainer's `world_size()` is the number of trainers, and FSDP, checkpoints and
logging work among them as in a colocated run; the rollout ranks form theirs). Two more gloo groups join the
first trainer with every rollout rank: `link` carries commands and weights from the trainer (broadcasts, in
order), `results` carries what the rollout ranks send back (their first rank to the trainer), so that a
result can arrive while the trainer broadcasts the next command. Objects travel pickled in uint8 tensors.
"""

import datetime
import logging
import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroupGloo

logger = logging.getLogger(__name__)

TRAIN, ROLLOUT = "train", "rollout"


@dataclass
class Placement:
    """Where this rank stands: its `role`, its rank in the torchrun world, the sizes of both sides, and the
    groups between them (None on trainers other than the first)."""

    role: str
    global_rank: int
    trainers: int
    rollouts: int
    link: ProcessGroupGloo | None
    results: ProcessGroupGloo | None

    @property
    def link_rank(self) -> int:
        """This rank's rank in `link`: 0 for the first trainer, 1.. for the rollout ranks."""
        return 0 if self.role == TRAIN else 1 + self.global_rank - self.trainers


def placement_device_index(local_rank: int, devices: int) -> int:
    """The GPU of a rank on a node with `devices` GPUs: its own, or shared round-robin when the node has fewer
    GPUs than ranks. Each role has its own process group, so one trainer and one rollout rank can share a GPU
    (one-step-off on a single GPU); ranks of the same role on one GPU cannot (NCCL refuses duplicates)."""
    if local_rank >= devices:
        logger.warning("rank with LOCAL_RANK=%d shares GPU %d: the node has %d", local_rank, local_rank % devices,
                       devices)
    return local_rank % devices


def init_placement(rollout_ranks: int, timeout_minutes: int = 30) -> Placement:
    """Split the torchrun world (see the module); every rank calls it once, before anything else
    distributed. A ValueError when the world has no rank left to train or to generate."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    trainers = world - rollout_ranks
    if rollout_ranks < 1 or trainers < 1:
        raise ValueError(f"rollout.ranks={rollout_ranks} leaves {trainers} of the {world} ranks to train: split "
                         "placement needs at least one of each (torchrun --nproc_per_node)")
    role = TRAIN if rank < trainers else ROLLOUT
    role_rank, role_size = (rank, trainers) if role == TRAIN else (rank - trainers, rollout_ranks)
    if torch.cuda.is_available():
        torch.cuda.set_device(placement_device_index(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=PrefixStore(role, store), rank=role_rank, world_size=role_size,
                            timeout=timeout)
    link = results = None
    if rank == 0 or role == ROLLOUT:
        link_rank = 0 if rank == 0 else 1 + rank - trainers
        link = ProcessGroupGloo(PrefixStore("link", store), link_rank, rollout_ranks + 1, timeout)
        if rank == 0 or rank == trainers:  # the first trainer and the first rollout rank
            results = ProcessGroupGloo(PrefixStore("results", store), 0 if rank == 0 else 1, 2, timeout)
    return Placement(role, rank, trainers, rollout_ranks, link, results)


def broadcast_object(group: ProcessGroupGloo, obj=None, root: int = 0):
    """`obj` from the group's rank `root`, on every rank of `group` (a collective)."""
    if group.rank() == root:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
    else:
        size = torch.zeros(1, dtype=torch.long)
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([size], options).wait()
    if group.rank() != root:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.broadcast([data], options).wait()
    return obj if group.rank() == root else pickle.loads(data.numpy().tobytes())


def broadcast_tensor(group: ProcessGroupGloo, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
    """`tensor` from `root` into `tensor` on every rank (the others pass one of the same shape and dtype)."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()
    return tensor


def send_object(group: ProcessGroupGloo, obj, dst: int) -> None:
    """Send `obj` to `dst` of `group`; returns once `dst` has received it."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    group.send([torch.tensor([data.numel()], dtype=torch.long)], dst, 0).wait()
    group.send([data], dst, 1).wait()


def recv_object(group: ProcessGroupGloo, src: int):
    """The next object `src` sends over `group`."""
    size = torch.zeros(1, dtype=torch.long)
    group.recv([size], src, 0).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    group.recv([data], src, 1).wait()
    return pickle.loads(data.numpy().tobytes())
