"""Stream an FSDP2 model's full weights, bucket by bucket, to an inference engine."""

from collections.abc import Iterator

import torch
from torch import nn

from rl2.fsdp import DTYPES


def iter_full_weights(
    model: nn.Module, dtype: str = "bfloat16", bucket_mb: int = 512
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of `model`'s state dict, in state-dict order.

    Sharded tensors are all-gathered a bucket (about `bucket_mb` of `dtype`) at a time and cast
    to `dtype`; a bucket is released once the consumer moves past it, so a rank never holds more
    than one bucket of gathered weights besides the engine's own copy. Every rank must consume
    the whole stream in the same order: the gathers are collectives.
    """
    target = DTYPES[dtype]
    limit = bucket_mb * 2**20
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in model.state_dict().items():
        bucket.append((name, tensor))
        size += tensor.numel() * target.itemsize
        if size >= limit:
            yield from _gathered(bucket, target)
            bucket, size = [], 0
    yield from _gathered(bucket, target)


def _gathered(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    full = []
    for name, tensor in bucket:
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        full.append((name, tensor.detach().to(dtype)))
    yield from full
