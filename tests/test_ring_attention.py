"""ZigZag split/gather and ring attention: layout by hand, then distributed runs against varlen attention."""

import importlib.util
import json

import pytest
import torch

from conftest import GRAD_RTOL, run_python, run_torchrun
from rl2.distributed.ring_attention import (
    FusedBlocks,
    _ring_pieces,
    ring_attention,
    ring_kernel,
    zigzag_cu_seqlens,
    zigzag_position_ids,
    zigzag_split,
)


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def test_zigzag_split_by_hand():
    # sp=2: lengths [5, 1, 8] pad to [8, 4, 8] in 4 chunks of [2, 1, 2]; rank 0 keeps chunks 0 and
    # 3, rank 1 chunks 1 and 2. Sequences hold tokens 100..104 | 105 | 106..113.
    cu = cu_of([5, 1, 8])
    row = (torch.arange(14) + 100).unsqueeze(0)
    assert zigzag_split(row, cu, 0, 2, pad_value=-1).tolist() == [[100, 101, -1, -1, 105, -1, 106, 107, 112, 113]]
    assert zigzag_split(row, cu, 1, 2, pad_value=-1).tolist() == [[102, 103, 104, -1, -1, -1, 108, 109, 110, 111]]
    assert zigzag_position_ids(cu, 0, 2).tolist() == [[0, 1, 6, 7, 0, 3, 0, 1, 6, 7]]
    assert zigzag_position_ids(cu, 1, 2).tolist() == [[2, 3, 4, 5, 1, 2, 2, 3, 4, 5]]
    local_cu = zigzag_cu_seqlens(cu, 2)
    assert local_cu.dtype == torch.int32 and local_cu.tolist() == [0, 4, 6, 10]
    # sp=1 keeps each sequence whole, padded to an even length (two chunks).
    assert zigzag_split(row, cu, 0, 1, pad_value=0).tolist() == [[100, 101, 102, 103, 104, 0, 105, 0] + list(range(106, 114))]
    assert zigzag_position_ids(cu, 0, 1).tolist() == [[0, 1, 2, 3, 4, 5, 0, 1] + list(range(8))]


def test_zigzag_split_shapes_and_grad():
    cu = cu_of([3, 6])
    row = torch.randn(1, 9, 2, 5, requires_grad=True)
    local = zigzag_split(row, cu, 1, 2)
    assert local.shape == (1, 6, 2, 5)
    assert zigzag_split(row[0, :, 0, 0], cu, 1, 2).shape == (6,)
    local.sum().backward()
    # Rank 1 of sp=2 holds positions 1, 2 of the first sequence (chunks of 1) and 2..5 of the second.
    expected = torch.zeros(9)
    expected[[1, 2, 5, 6, 7, 8]] = 1
    assert torch.equal(row.grad[0, :, 0, 0], expected)
    with pytest.raises(ValueError):
        zigzag_split(torch.zeros(2, 9), cu, 0, 2)
    with pytest.raises(ValueError):
        zigzag_split(torch.zeros(1, 10), cu, 0, 2)
    with pytest.raises(ValueError):
        zigzag_split(torch.zeros(1, 9), cu, 2, 2)


def inverse_by_loops(locals_: list[torch.Tensor], lengths: list[int], sp: int) -> torch.Tensor:
    """The original row from every rank's [T_local] part, written independently of the module."""
    out = []
    for i, length in enumerate(lengths):
        chunk = -(-length // (2 * sp))
        pieces = {}
        for r in range(sp):
            start = sum(2 * (-(-n // (2 * sp))) for n in lengths[:i])
            pieces[r] = locals_[r][start : start + chunk]
            pieces[2 * sp - 1 - r] = locals_[r][start + chunk : start + 2 * chunk]
        out.append(torch.cat([pieces[c] for c in range(2 * sp)])[:length])
    return torch.cat(out)


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_zigzag_round_trip_and_positions(sp):
    gen = torch.Generator().manual_seed(sp)
    lengths = [1, 2 * sp, 2 * sp + 1, 2 * sp - 1] + [int(x) for x in torch.randint(1, 50, (6,), generator=gen)]
    cu = cu_of(lengths)
    row = torch.arange(sum(lengths)) + 1
    true_positions = torch.cat([torch.arange(n) for n in lengths])
    locals_ = [zigzag_split(row, cu, r, sp, pad_value=0) for r in range(sp)]
    assert len({x.numel() for x in locals_}) == 1  # the same local length on every rank
    assert int(zigzag_cu_seqlens(cu, sp)[-1]) == locals_[0].numel()
    assert torch.equal(inverse_by_loops(locals_, lengths, sp), row)
    for r, local in enumerate(locals_):
        positions = zigzag_position_ids(cu, r, sp)[0]
        real = local > 0
        assert torch.equal(positions[real], true_positions[local[real] - 1])  # real tokens: their true position
        # Positions run on past L_i into the padding, so RoPE of real tokens is untouched.
        bounds = zigzag_cu_seqlens(cu, sp).tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            half = (end - start) // 2
            assert positions[start : start + half].tolist() == list(range(r * half, (r + 1) * half))
            assert positions[start + half : end].tolist() == list(range((2 * sp - 1 - r) * half, (2 * sp - r) * half))


def test_ring_attention_rejects_bad_inputs():
    q = torch.zeros(1, 4, 6, 8)
    kv = torch.zeros(1, 2, 6, 8)
    with pytest.raises(ValueError, match="batch size"):
        ring_attention(q.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1), cu_of([6]), None)
    with pytest.raises(ValueError):
        ring_attention(q, torch.zeros(1, 3, 6, 8), torch.zeros(1, 3, 6, 8), cu_of([6]), None)
    with pytest.raises(ValueError):
        ring_attention(q, kv, kv, cu_of([3, 3]), None)  # odd: not a zigzag layout


@pytest.mark.parametrize("sp", [1, 2, 3, 4])
def test_ring_pieces_cover_exactly_the_visible_pairs(sp):
    """Each block of queries against another rank's keys, as causal-or-full pieces, is exactly the
    causal mask by true position within each sequence."""
    cu = cu_of([1, 2 * sp, 2 * sp + 1, 7, 30])
    local_cu = zigzag_cu_seqlens(cu, sp)
    local_lengths = (local_cu[1:] - local_cu[:-1]).long()
    sequence = torch.repeat_interleave(torch.arange(len(local_lengths)), local_lengths)
    for q_rank in range(sp):
        for k_rank in range(sp):
            q_pos, k_pos = zigzag_position_ids(cu, q_rank, sp)[0], zigzag_position_ids(cu, k_rank, sp)[0]
            visible = (sequence[:, None] == sequence[None, :]) & (k_pos[None, :] <= q_pos[:, None])
            covered = torch.zeros_like(visible)
            for rows, cols, causal in _ring_pieces(local_cu.tolist(), q_rank, k_rank, sp):
                block = torch.ones(rows.stop - rows.start, cols.stop - cols.start, dtype=torch.bool)
                covered[rows, cols] = block.tril() if causal else block
            assert torch.equal(covered, visible), (q_rank, k_rank)


def test_ring_kernel_choice():
    cpu = torch.zeros(1, 4, 6, 8)
    assert ring_kernel(cpu) == "fused" and ring_kernel(cpu, "torch") == "torch"
    assert ring_kernel(torch.zeros(1, 4, 6, 8, device="meta")) == "torch"  # no fused kernel for that device
    with pytest.raises(RuntimeError, match="ring-flash-attn"):
        ring_kernel(cpu, "flash")
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        ring_kernel(torch.zeros(1, 4, 6, 8, device="meta"), "fused")
    with pytest.raises(ValueError, match="kernel must be one of"):
        ring_kernel(cpu, "fast")


def test_fused_blocks_call_the_cuda_kernels_with_their_schema():
    """The CUDA branch of FusedBlocks against the flash ops' meta kernels: the arguments it passes
    (the forward's sequence and random state handed back to the backward, as autograd does) fit this
    torch's schemas, and the shapes come back in the grouped layout."""
    # Tensors that carry only shapes take the branch that is not the CPU's.
    q = torch.empty(2, 3, 5, 16, device="meta", dtype=torch.bfloat16)  # 2 KV heads, 3 queries each
    k = v = torch.empty(2, 7, 16, device="meta", dtype=torch.bfloat16)
    out, lse, state = FusedBlocks.forward(q, k, v, False, 0.25)
    assert out.shape == q.shape and out.dtype == torch.float32 and lse.shape == (2, 3, 5) and len(state) == 6
    d_q, d_k, d_v = FusedBlocks.backward(out, q, k, v, out, lse, False, 0.25, state)
    assert d_q.shape == q.shape and d_k.shape == k.shape and d_v.shape == v.shape


FP32_TOL = 1e-5  # float32 attention over <100 keys of O(1) values (and logits ~1) vs the reference: ~1e-6
BF16_TOL = 3e-2  # bf16 rounding of outputs and gradients of magnitude ~1


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_ring_attention_matches_varlen(tiny_model_dir, tmp_path, nproc):
    """Output, dq/dk/dv, zigzag_gather and a tiny Qwen2 model (logits, SP-summed grads) vs one process."""
    out = tmp_path / "errors.json"
    args = ["tests/workers/ring_attention_check.py", tiny_model_dir, str(out)]
    # A ring mismatch deadlocks rather than erroring: a short timeout makes that a quick failure.
    if nproc == 1:
        run_python(args, timeout=120)
    else:
        run_torchrun(args, nproc=nproc, timeout=120)
    errors = json.loads(out.read_text())
    expected = {f"sp{nproc}/torch/fp32/dv", f"sp{nproc}/fused/fp32/dv", f"sp{nproc}/fused/bf16/dq", "gather_backward", "missing_cu_seqlens_raises"}
    expected |= {"model/grads/relative", "model/ckpt/grads/relative", "model/local_logps/grads/relative"}
    if nproc == 4:
        expected.add("sp2_subgroup/auto/fp32/dq")
    assert expected <= set(errors)
    for name, err in errors.items():
        tolerance = BF16_TOL if "bf16" in name else GRAD_RTOL if name.endswith("grads/relative") else FP32_TOL
        assert err < tolerance, (name, err, errors)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and importlib.util.find_spec("ring_flash_attn") is not None),
    reason="the fused path needs CUDA and ring-flash-attn (pip install ring-flash-attn)",
)
def test_flash_kernel_matches_torch_kernel():
    """On a GPU: ring-flash-attn's zigzag kernel and the pure-torch ring agree (bf16), values and grads."""
    from rl2.distributed.process_group import init_distributed

    init_distributed()
    group = torch.distributed.group.WORLD
    generator = torch.Generator(device="cuda").manual_seed(0)
    local_cu = zigzag_cu_seqlens(cu_of([37, 1, 300, 64]), torch.distributed.get_world_size())
    total = int(local_cu[-1])
    results = {}
    for kernel in ("torch", "flash"):
        q, k, v = (
            torch.randn(1, h, total, 64, device="cuda", generator=generator.manual_seed(i), dtype=torch.bfloat16)
            .requires_grad_()
            for i, h in enumerate((8, 2, 2))
        )
        out = ring_attention(q, k, v, local_cu, group, kernel=kernel)
        out.float().square().sum().backward()
        results[kernel] = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["torch"], results["flash"]):
        torch.testing.assert_close(a, b, atol=BF16_TOL, rtol=BF16_TOL, msg=name)
