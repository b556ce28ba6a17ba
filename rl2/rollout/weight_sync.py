"""Stream an FSDP2 model's full weights, bucket by bucket, to an inference engine."""

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from rl2.distributed.fsdp import DTYPES
from rl2.lora import adapted_weights, adapter_keys, is_lora, merge


def iter_full_weights(
    model: nn.Module, dtype: str = "bfloat16", bucket_mb: int = 512, adapted_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of `model`'s state dict, in state-dict order, a tied
    parameter once (under its first name: engines tie it back). With LoRA adapters (`rl2.lora`) each
    adapted weight goes out merged (W + B A · alpha / r, under the base layer's name) and the adapters
    themselves not at all; `adapted_only` sends only those merged weights (the rest is the base model's,
    which an engine that kept its weights already holds).

    Sharded tensors are cast to `dtype` on each rank and then all-gathered (half the bytes of
    gathering fp32 masters), a bucket (about `bucket_mb` of `dtype`) at a time, FSDP2's row shards
    of a bucket in one collective; a bucket is released
    once the consumer moves past it, so a rank never holds more than one bucket of gathered weights
    besides the engine's own copy. Every rank must consume the whole stream in the same order: the
    gathers are collectives.
    """
    target = DTYPES[dtype]
    limit = bucket_mb * 2**20
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tied -= {name for name, _ in model.named_parameters()}
    adapted = adapted_weights(model) if is_lora(model) else {}
    state_dict = model.state_dict()
    bucket: list[tuple[str, torch.Tensor, tuple | None]] = []
    size = 0
    for name, tensor in state_dict.items():
        if name in tied or ".lora_" in name:
            continue
        adapter = None
        if name in adapted:
            adapter = tuple(state_dict[key] for key in adapter_keys(adapted[name].prefix)) + (adapted[name],)
        elif adapted_only:
            continue
        bucket.append((name, tensor, adapter))
        size += tensor.numel() * target.itemsize
        if size >= limit:
            yield from _gathered(bucket, target)
            bucket, size = [], 0
    yield from _gathered(bucket, target)


def _full(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(tensor, DTensor) and tensor.device_mesh.size() == 1:
        # one rank holds it all: its local tensor, without DTensor's dispatch (~0.1 ms a tensor on a GPU)
        return tensor.to_local().detach().to(dtype)
    tensor = tensor.detach().to(dtype)  # a DTensor casts its local shard
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _gathered(bucket: list[tuple[str, torch.Tensor, tuple | None]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    together = [tensor for _, tensor, adapter in bucket if adapter is None and _row_sharded(tensor)]
    gathered = dict(zip(map(id, together), _full_row_sharded(together, dtype)))
    full = []
    for name, tensor, adapter in bucket:
        if id(tensor) in gathered:
            full.append((name, gathered[id(tensor)]))
        elif adapter is None:
            full.append((name, _full(tensor, dtype)))
        else:  # the adapters are small: gathered in fp32, merged in fp32 into the cast base weight
            lora_a, lora_b, how = adapter
            full.append((name, merge(_full(tensor, dtype), _full(lora_a, torch.float32), _full(lora_b, torch.float32),
                                     how)))
    yield from full


def _row_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor sharded by rows over a 1-D mesh (FSDP2's parameters), which `_full_row_sharded` gathers."""
    return isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1 and tuple(tensor.placements) == (Shard(0),)


def _full_row_sharded(tensors: list[DTensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """The full tensors of row-sharded DTensors on one mesh, cast to `dtype` first, with one all-gather for
    all of them (one per tensor costs a collective's latency each: most of a small model's sync)."""
    if not tensors:
        return []
    mesh = tensors[0].device_mesh
    world = mesh.size()
    if world == 1 or any(t.device_mesh != mesh for t in tensors):
        return [_full(t, dtype) for t in tensors]
    # rank r holds rows [r c, (r + 1) c) of each, c = ceil(rows / world) (torch.chunk's split; maybe none)
    def share(tensor: DTensor, rank: int) -> int:
        rows = tensor.shape[0]
        chunk = -(-rows // world)
        return max(0, min(chunk, rows - rank * chunk)) * math.prod(tensor.shape[1:])

    sizes = [[share(t, r) for t in tensors] for r in range(world)]
    longest = max(sum(s) for s in sizes)
    local = torch.cat([t.to_local().detach().to(dtype).reshape(-1) for t in tensors])
    padded = torch.zeros(longest, dtype=dtype, device=local.device)
    padded[: local.numel()] = local
    out = torch.empty(world * longest, dtype=dtype, device=local.device)
    dist.all_gather_into_tensor(out, padded, group=mesh.get_group())
    pieces = [out[r * longest: r * longest + sum(sizes[r])].split(sizes[r]) for r in range(world)]
    return [torch.cat([pieces[r][i] for r in range(world)]).view(t.shape) for i, t in enumerate(tensors)]
