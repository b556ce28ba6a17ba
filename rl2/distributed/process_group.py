"""Process group, device and DeviceMesh set-up: NCCL on CUDA, gloo on CPU, world size 1 without torchrun."""

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger(__name__)


def init_distributed(timeout_minutes: int = 30) -> None:
    """Join the torchrun process group, or make a one-process group when not launched by torchrun.

    A group that already exists (a second trainer in the same notebook) is reused.
    """
    if dist.is_initialized():
        return
    timeout = timedelta(minutes=timeout_minutes)
    cuda = torch.cuda.is_available()
    # gloo alongside NCCL so CPU tensors (object gathers, counts) can be reduced too.
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    else:
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def device() -> torch.device:
    """The device this rank computes on."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank0() -> bool:
    return rank() == 0


def build_fsdp_mesh(fsdp_size: int) -> DeviceMesh:
    """A mesh over all ranks for FSDP: 1-D (full sharding) or 2-D (`ddp`, `fsdp`) for hybrid sharding.

    `fsdp_size` 0 or the world size shards every parameter across all ranks; a smaller divisor
    shards within groups of `fsdp_size` ranks and replicates across groups (HSDP).
    """
    world = world_size()
    fsdp_size = fsdp_size or world
    if fsdp_size < 1 or world % fsdp_size != 0:
        raise ValueError(f"fsdp_size={fsdp_size} must divide the world size {world} (0 means all ranks)")
    device_type = device().type
    if fsdp_size == world:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    return init_device_mesh(device_type, (world // fsdp_size, fsdp_size), mesh_dim_names=("ddp", "fsdp"))


def build_sp_group(sp_size: int) -> dist.ProcessGroup:
    """The process group of this rank's sequence-parallel group: ranks r·sp .. r·sp + sp − 1."""
    world = world_size()
    if sp_size < 1 or world % sp_size != 0:
        raise ValueError(f"sp_size={sp_size} must divide the world size {world}")
    mesh = init_device_mesh(device().type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    return mesh.get_group("sp")


def all_reduce_sum(value: float | torch.Tensor) -> float | torch.Tensor:
    """Sum a number or tensor over all ranks (a new value; the input is left as it was)."""
    is_tensor = isinstance(value, torch.Tensor)
    tensor = value.detach().clone() if is_tensor else torch.tensor(float(value), dtype=torch.float64)
    if world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor if is_tensor else tensor.item()


def rank_slice(n: int) -> tuple[int, int]:
    """The contiguous slice (start, end) of n items this rank handles; sizes differ by at most one."""
    return n * rank() // world_size(), n * (rank() + 1) // world_size()


def all_gather_objects(items: list) -> list:
    """Every rank's list concatenated in rank order (picklable items), on every rank."""
    if world_size() == 1:
        return list(items)
    gathered: list = [None] * world_size()
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


def broadcast_from_rank0(value):
    """Rank 0's `value` (picklable), on every rank."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()




def shutdown_distributed() -> None:
    """Wait until every rank is done, so none exits while a peer still needs it.

    The process group is left to process exit: on torch 2.13 with gloo, `destroy_process_group`
    intermittently aborts a rank at interpreter shutdown ("terminate called without an active
    exception").

    A rank that has left the barrier may exit, and its peer's read of the barrier's last message
    can then fail with "Connection reset by peer". That peer left the barrier, so every rank got
    there: the error is taken as the barrier passed.
    """
    try:
        barrier()
    except RuntimeError as error:
        if not any(sign in str(error) for sign in PEER_GONE):
            raise
        logger.debug("final barrier: a peer that had passed it already exited (%s)", error)


PEER_GONE = ("Connection reset by peer", "Connection closed by peer")  # gloo's messages when a peer exited


def exit_process(code: int = 0) -> None:
    """End a command-line run once all ranks are done, skipping interpreter teardown.

    With torch 2.13 + gloo a rank intermittently aborts during teardown ("terminate called without
    an active exception": a C++ thread still joinable at exit) after all its work is done, which
    would turn a finished run into a failed one. Callers finish their own output first.
    """
    import logging
    import sys

    shutdown_distributed()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
