"""Packed rows of random token ids, as rl2's workers hand them to a model: shared by the tests of model families
in packed rows (tests/test_moe_models.py, tests/test_hybrid_packing.py)."""

import pytest
import torch

from rl2.distributed.packing import pack_micro_batch
from rl2.kernels.attention import packed_attention_implementation


@pytest.fixture(scope="module")
def varlen() -> str:
    return packed_attention_implementation(torch.device("cpu"))


def sequences(lengths: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1024, (n,), generator=generator) for n in lengths]


def packed_inputs(seqs: list[torch.Tensor]) -> dict:
    """A packed row's model inputs, as rl2's `ModelWorker._model_inputs` gives them."""
    row = pack_micro_batch([{"input_ids": s} for s in seqs])
    cu_seqlens = row["cu_seqlens"]
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return dict(input_ids=row["input_ids"], position_ids=row["position_ids"], cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest, use_cache=False)
