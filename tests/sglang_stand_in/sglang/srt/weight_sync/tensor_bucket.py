"""Stand-in for sglang.srt.weight_sync.tensor_bucket: tensors flattened into one buffer."""

from dataclasses import dataclass

import torch


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """One 1-D tensor holding a bucket of tensors, and where each one lies in it.

    Stricter than SGLang's: a bucket must hold one dtype (SGLang's, `supports_multi_dtypes`, views
    every tensor as bytes; rl2 buckets by dtype, and a mixed bucket here is a bucket-planning mistake).
    """

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("Cannot create empty tensor bucket")
            dtypes = {tensor.dtype for _, tensor in named_tensors}
            if len(dtypes) > 1:
                raise ValueError(f"a flattened bucket must hold one dtype, got {dtypes}")
            self.metadata, start = [], 0
            for name, tensor in named_tensors:
                numel = tensor.numel()
                self.metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start, start + numel, numel))
                start += numel
            self.flattened_tensor = torch.cat([tensor.detach().flatten() for _, tensor in named_tensors])
        else:
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list:
        return self.metadata

    def reconstruct_tensors(self) -> list:
        return [
            (meta.name, self.flattened_tensor[meta.start_idx : meta.end_idx].reshape(meta.shape).to(meta.dtype))
            for meta in self.metadata
        ]
