"""Sequence parallelism for packed rows: ZigZag split and ring attention over an SP process group.

A packed row ([1, T], several sequences, `cu_seqlens`) is spread over the `sp` ranks of a group.
Each sequence is padded at its end to a multiple of 2·sp tokens and cut into 2·sp equal chunks;
rank r keeps chunks r and 2·sp−1−r of every sequence ("zigzag", as in
zhuzilin/ring-flash-attention), so every rank gets an equal share of the causal work: an early
chunk, which attends to little, paired with a late one, which attends to a lot. Every rank's local
row has the same per-sequence lengths, so the local `cu_seqlens` are the same everywhere and any
rank can work out the true positions of any other rank's tokens without communication.

`ring_attention` then runs causal attention within each sequence as if on the whole row: K/V blocks
travel around the ring (Ring Attention, Liu et al. 2023) and the partial outputs are merged by
their log-sum-exp. Under the zigzag layout every piece of a block (one sequence's queries against
its keys on another rank) is either causal or full, so each piece runs through torch's fused flash
kernel for the device (`FusedBlocks`, CPU or CUDA in bf16/fp16; O(T) memory), whose backward, given
the merged output and log-sum-exp, gives the piece's exact share of the gradient. `TorchBlocks`
materialises each piece's float32 scores instead ([H, 2c_i, 2c_i], memory growing with (L_i / sp)²):
the reference, and the path for devices or dtypes the fused kernel does not take.

Recipe for a transformers model (see `ring_attention_implementation`):

    local_ids = zigzag_split(row["input_ids"], cu, rank, sp, pad_value=pad_id)
    local_cu = zigzag_cu_seqlens(cu, sp)
    logits = model(input_ids=local_ids, position_ids=zigzag_position_ids(cu, rank, sp),
                   cu_seq_lens_q=local_cu, cu_seq_lens_k=local_cu, use_cache=False).logits
    logits = zigzag_gather(logits, cu, group)  # [1, T, V], the same on every SP rank

with `model.config._attn_implementation = ring_attention_implementation(group)`. Gathering
[1, T_local] per-token log-probs instead of logits saves sp·T·V floats: split the next-token
targets (`torch.roll(input_ids, -1, dims=1)`) with `zigzag_split`, take log-probs locally, gather
those. Only `cu_seq_lens_q` is read (`cu_seq_lens_k`, `max_length_q/k` are accepted and ignored);
`position_ids` carry the true positions for RoPE. Every SP rank then computes the same loss on
the whole row; summing parameter gradients over the SP group (FSDP's reduction does this when the
SP ranks are also data-parallel ranks of it) gives the gradient of that loss.
"""

import functools
import importlib.util

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from rl2.kernels.attention import no_dense_mask

# ---------------------------------------------------------------------------------------------
# ZigZag layout
# ---------------------------------------------------------------------------------------------


def _check_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None) -> list[int]:
    """`cu_seqlens` read to the host (one copy), after checking it describes a packed row of `total` tokens."""
    bounds = cu_seqlens.tolist() if cu_seqlens.dim() == 1 else None
    valid = bounds is not None and len(bounds) >= 1 and bounds[0] == 0
    valid = valid and all(a <= b for a, b in zip(bounds, bounds[1:]))
    valid = valid and (total is None or bounds[-1] == total)
    if not valid:
        raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} do not describe a packed row of length {total}")
    return bounds


def _check_sp(sp_rank: int, sp_size: int) -> None:
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"need 0 <= sp_rank < sp_size, got sp_rank={sp_rank}, sp_size={sp_size}")


def zigzag_cu_seqlens(cu_seqlens: torch.Tensor, sp_size: int) -> torch.Tensor:
    """Local cu_seqlens (int32, [n+1]) of the zigzag split: the same on every rank of the group.

    Sequence i keeps 2·c_i tokens per rank, c_i = ceil(L_i / (2·sp)).
    """
    _check_cu_seqlens(cu_seqlens)
    _check_sp(0, sp_size)
    lengths = cu_seqlens[1:].long() - cu_seqlens[:-1].long()
    chunks = (lengths + 2 * sp_size - 1) // (2 * sp_size)
    local = torch.cat([chunks.new_zeros(1), torch.cumsum(2 * chunks, 0)])
    return local.to(torch.int32)


def _local_layout(local_cu_seqlens: torch.Tensor, sp_rank: int, sp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, true position in the sequence) of each token in rank `sp_rank`'s local row.

    Needs only the local cu_seqlens, which are shared: sequence i has chunks of c_i = local_len_i / 2
    tokens, and rank r holds chunk r (positions r·c_i ...) then chunk 2·sp−1−r.
    """
    local_lens = local_cu_seqlens[1:].long() - local_cu_seqlens[:-1].long()
    seq = torch.repeat_interleave(torch.arange(len(local_lens), device=local_lens.device), local_lens)
    offset = torch.arange(len(seq), device=seq.device) - local_cu_seqlens[:-1].long()[seq]
    chunk = (local_lens // 2)[seq]
    first = offset < chunk
    position = torch.where(first, sp_rank * chunk + offset, (2 * sp_size - 1 - sp_rank) * chunk + offset - chunk)
    return seq, position


def zigzag_position_ids(cu_seqlens: torch.Tensor, sp_rank: int, sp_size: int) -> torch.Tensor:
    """True positions ([1, T_local], long) of this rank's tokens; padding continues past L_i."""
    _check_sp(sp_rank, sp_size)
    _, position = _local_layout(zigzag_cu_seqlens(cu_seqlens, sp_size), sp_rank, sp_size)
    return position.unsqueeze(0)


def _source_index(cu_seqlens: torch.Tensor, sp_rank: int, sp_size: int) -> torch.Tensor:
    """Index in the original row of each of this rank's local tokens, -1 for padding ([T_local])."""
    seq, position = _local_layout(zigzag_cu_seqlens(cu_seqlens, sp_size), sp_rank, sp_size)
    starts = cu_seqlens[:-1].long().to(seq.device)
    lengths = cu_seqlens[1:].long().to(seq.device) - starts
    return torch.where(position < lengths[seq], starts[seq] + position, -1)


def _token_dim(tensor: torch.Tensor) -> int:
    """The token dim of a per-token tensor: 0 for [T], 1 for [1, T, ...]."""
    if tensor.dim() == 1:
        return 0
    if tensor.shape[0] != 1:
        raise ValueError(f"expected a [T] or [1, T, ...] per-token tensor, got shape {tuple(tensor.shape)}")
    return 1


def zigzag_split(
    row: torch.Tensor, cu_seqlens: torch.Tensor, sp_rank: int, sp_size: int, pad_value: float | int = 0
) -> torch.Tensor:
    """This rank's part of a per-token tensor of a packed row: [1, T, ...] → [1, T_local, ...] (or [T] → [T_local]).

    Local row = [seq0 chunk r, seq0 chunk 2sp−1−r, seq1 chunk r, ...]; each sequence is padded at
    its end with `pad_value`. Differentiable (an index_select).
    """
    _check_sp(sp_rank, sp_size)
    dim = _token_dim(row)
    _check_cu_seqlens(cu_seqlens, row.shape[dim])
    source = _source_index(cu_seqlens, sp_rank, sp_size).to(row.device)
    # Append one padding token at index T and point the padding slots at it.
    pad_shape = list(row.shape)
    pad_shape[dim] = 1
    padded = torch.cat([row, row.new_full(pad_shape, pad_value)], dim=dim)
    return padded.index_select(dim, torch.where(source < 0, row.shape[dim], source))


class _ZigzagGather(torch.autograd.Function):
    """all_gather of the local rows, reordered into the original row.

    Backward returns each rank's own slice of the incoming gradient, without reduction: all SP
    ranks compute the same loss on the gathered row, so that slice is already the exact gradient
    of this rank's tokens (summing over ranks would count it sp times).
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        sp_rank, sp_size = dist.get_rank(group), dist.get_world_size(group)
        dim = _token_dim(local)
        total = int(cu_seqlens[-1])
        if sp_size == 1:
            parts = [local]
        else:
            parts = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(sp_size)]
            dist.all_gather(parts, local.contiguous(), group=group)
        # For each original token, its index in the concatenation of the ranks' local rows.
        sources = torch.cat([_source_index(cu_seqlens, r, sp_size) for r in range(sp_size)]).to(local.device)
        order = torch.empty(total, dtype=torch.long, device=local.device)
        real = sources >= 0
        order[sources[real]] = torch.nonzero(real).reshape(-1)
        ctx.cu_seqlens, ctx.sp_rank, ctx.sp_size = cu_seqlens, sp_rank, sp_size
        return torch.cat(parts, dim=dim).index_select(dim, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return zigzag_split(grad, ctx.cu_seqlens, ctx.sp_rank, ctx.sp_size, pad_value=0), None, None


def zigzag_gather(local: torch.Tensor, cu_seqlens: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of `zigzag_split` across `group`: [1, T_local, ...] → [1, T, ...] in the original order
    without padding, on every rank. `cu_seqlens` are the original (global) ones.

    Autograd: each rank gets back the slice of the gradient that belongs to its own tokens.
    """
    dim = _token_dim(local)
    expected = int(zigzag_cu_seqlens(cu_seqlens, dist.get_world_size(group))[-1])
    if local.shape[dim] != expected:
        raise ValueError(f"local row has {local.shape[dim]} tokens, the zigzag split of {cu_seqlens.tolist()} has {expected}")
    return _ZigzagGather.apply(local, cu_seqlens, group)


# ---------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------


def _ring_send_recv(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> tuple[list[torch.Tensor], list]:
    """Start sending `tensors` to the next rank of the ring and receiving the previous rank's."""
    sp_rank, sp_size = dist.get_rank(group), dist.get_world_size(group)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(sp_rank + 1) % sp_size) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(sp_rank - 1) % sp_size) for t in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _ring_pieces(bounds: list[int], q_rank: int, k_rank: int, sp_size: int) -> list[tuple[slice, slice, bool]]:
    """The attention block of q_rank's queries against k_rank's keys, as (query rows, key columns,
    causal) per sequence, slices of the local row; `bounds` are the local cu_seqlens, on the host.

    Every rank's local row has the same sequence slices, so a block is block-diagonal by sequence:
    only sequence i's local slice attends to sequence i's slice (work Σ(2c_i)², not T_local²). With
    the zigzag layout each piece is either causal or full: on the diagonal (k_rank = q_rank) the
    local positions increase along the slice, so it is causal; a block from an earlier rank is seen
    whole, but only its first chunk, by every query; one from a later rank is seen whole by the
    second chunk of queries only. That halves the work of every off-diagonal step.
    """
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        middle = start + (end - start) // 2
        if k_rank == q_rank:
            pieces.append((slice(start, end), slice(start, end), True))
        elif k_rank < q_rank:
            pieces.append((slice(start, end), slice(start, middle), False))
        else:
            pieces.append((slice(middle, end), slice(start, end), False))
    return pieces


class TorchBlocks:
    """Attention of one piece from float32 scores it materialises: any device and dtype; the
    reference. Queries are grouped by KV head: q [Hkv, G, Tq, D], k/v [Hkv, Tk, D]."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(out [Hkv, G, Tq, D], lse [Hkv, G, Tq], state for backward), float32."""
        scores = _scores(q.float(), k.float(), causal, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = scores.sub_(lse[..., None]).exp_()
        return torch.matmul(probs, v.float().unsqueeze(1)), lse, None

    @staticmethod
    def backward(d_out, q, k, v, out, lse, causal: bool, scale: float, state) -> tuple[torch.Tensor, ...]:
        """(dq [Hkv, G, Tq, D], dk, dv [Hkv, Tk, D]) of the piece, given the whole attention's
        output and log-sum-exp of its rows (so P is the piece's share of the global softmax)."""
        q, k, v, d_out = q.float(), k.float(), v.float(), d_out.float()
        # FlashAttention backward: dS = P ∘ (dP − D) with D = rowsum(dO ∘ O) (Dao et al. 2022).
        delta = (d_out * out.float()).sum(-1)
        p = _scores(q, k, causal, scale).sub_(lse[..., None]).exp_()
        d_v = torch.matmul(p.transpose(-1, -2), d_out).sum(1)  # dV = Pᵀ dO
        d_s = torch.matmul(d_out, v.unsqueeze(1).transpose(-1, -2))  # dP = dO Vᵀ
        d_s = d_s.sub_(delta[..., None]).mul_(p)  # in place over dP
        del p
        d_q = torch.matmul(d_s, k.unsqueeze(1)) * scale  # dQ = dS K · scale
        d_k = torch.matmul(d_s.transpose(-1, -2), q).sum(1) * scale  # dK = dSᵀ Q · scale
        return d_q, d_k, d_v


class FusedBlocks:
    """Attention of one piece through torch's fused flash kernel for the device (CPU, or CUDA in
    fp16/bf16): no score matrix is kept, O(T) memory. Backward runs the kernel's backward with the
    whole attention's output and log-sum-exp, which gives the piece's exact share of the gradient
    (the trick of ring-flash-attention). Same layouts as `TorchBlocks`."""

    @staticmethod
    def supports(q: torch.Tensor) -> bool:
        if q.device.type == "cpu":
            return True
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256

    @staticmethod
    def _heads(q, k, v) -> tuple[torch.Tensor, ...]:
        """[Hkv, G, T, D] and [Hkv, T, D] → [1, H, T, D] each, KV heads repeated for their queries."""
        kv_heads, group, length, dim = q.shape
        expand = lambda x: x.repeat_interleave(group, dim=0).unsqueeze(0).contiguous()  # noqa: E731
        return q.reshape(1, kv_heads * group, length, dim).contiguous(), expand(k), expand(v)

    @classmethod
    def forward(cls, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        q_h, k_h, v_h = cls._heads(q, k, v)
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_h, k_h, v_h, 0.0, causal, scale=scale)
            state = ()
        else:
            # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng state ×2, debug mask): the
            # middle six go back to the backward op unchanged, as autograd does.
            result = torch.ops.aten._scaled_dot_product_flash_attention(q_h, k_h, v_h, 0.0, causal, False, scale=scale)
            out, lse, state = result[0], result[1], tuple(result[2:8])
        length = q.shape[2]
        return out.reshape(q.shape).float(), lse[..., :length].float().reshape(q.shape[:-1]), state

    @classmethod
    def backward(cls, d_out, q, k, v, out, lse, causal: bool, scale: float, state) -> tuple[torch.Tensor, ...]:
        q_h, k_h, v_h = cls._heads(q, k, v)
        as_heads = lambda x: x.reshape(q_h.shape[:-1] + x.shape[-1:]).to(q.dtype).contiguous()  # noqa: E731
        d_out_h, out_h = as_heads(d_out), as_heads(out)
        lse_h = lse.reshape(q_h.shape[:-1]).float().contiguous()
        if q.device.type == "cpu":
            d_q, d_k, d_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                d_out_h, q_h, k_h, v_h, out_h, lse_h, 0.0, causal, scale=scale
            )
        else:
            cum_q, cum_k, max_q, max_k, seed, offset = state
            d_q, d_k, d_v = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                d_out_h, q_h, k_h, v_h, out_h, lse_h, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
            )
        kv_heads, group = q.shape[:2]
        per_kv_head = lambda x: x[0].reshape(kv_heads, group, *x.shape[2:]).float().sum(1)  # noqa: E731
        return d_q[0].reshape(q.shape).float(), per_kv_head(d_k), per_kv_head(d_v)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Scores [Hkv, G, Tq, Tk] of grouped queries q [Hkv, G, Tq, D] against k [Hkv, Tk, D], causal
    (Tq = Tk) or not."""
    scores = torch.matmul(q, k.unsqueeze(1).transpose(-1, -2)).mul_(scale)
    if causal:
        above = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu_(1)
        scores.masked_fill_(above, float("-inf"))  # in place: the score blocks dominate memory
    return scores


class _RingAttention(torch.autograd.Function):
    """Causal varlen attention over a zigzag-split row; K/V go around the ring.

    Internally q is viewed as [Hkv, G, T, D] (G = H / Hkv query heads per KV head, transformers'
    repeat_kv order: head h uses KV head h // G), so K/V travel with Hkv heads and are never
    expanded on the wire. Each piece of a block is computed by `blocks` (`TorchBlocks` or
    `FusedBlocks`); outputs, log-sum-exps and gradient accumulators are float32.
    """

    @staticmethod
    def forward(ctx, q, k, v, bounds, group, scale, blocks):
        sp_rank, sp_size = dist.get_rank(group), dist.get_world_size(group)
        heads, kv_heads, length, dim = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
        qg = q[0].reshape(kv_heads, heads // kv_heads, length, dim)
        out = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k[0], v[0]])
        states = []
        # At step s this rank holds the K/V of rank r − s; backward walks the same pieces.
        pieces = [_ring_pieces(bounds, sp_rank, (sp_rank - step) % sp_size, sp_size) for step in range(sp_size)]
        for step in range(sp_size):
            if step + 1 < sp_size:  # overlap: the next block is on its way while this one computes
                (next_kv,), works = _ring_send_recv([kv], group)
            for rows, cols, causal in pieces[step]:
                block_out, block_lse, state = blocks.forward(qg[:, :, rows], kv[0, :, cols], kv[1, :, cols], causal, scale)
                states.append(state)
                # Merge by log-sum-exp: out = (e^lse·out + e^block_lse·block_out) / (e^lse + e^block_lse).
                # Every row of a piece sees at least one key, so the new lse is finite.
                old_lse = lse[:, :, rows]
                new_lse = torch.logaddexp(old_lse, block_lse)
                out[:, :, rows] = (
                    torch.exp(old_lse - new_lse)[..., None] * out[:, :, rows]
                    + torch.exp(block_lse - new_lse)[..., None] * block_out
                )
                lse[:, :, rows] = new_lse
            if step + 1 < sp_size:
                _wait(works)
                kv = next_kv
        output = out.reshape(heads, length, dim).transpose(0, 1).unsqueeze(0).to(q.dtype).contiguous()
        ctx.save_for_backward(q, k, v, output, lse)
        ctx.pieces, ctx.group, ctx.scale, ctx.blocks, ctx.states = pieces, group, scale, blocks, states
        return output

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, output, lse = ctx.saved_tensors
        pieces, group, scale, blocks, states = ctx.pieces, ctx.group, ctx.scale, ctx.blocks, iter(ctx.states)
        sp_size = dist.get_world_size(group)
        heads, kv_heads, length, dim = q.shape[1], k.shape[1], q.shape[2], q.shape[3]

        def grouped(x: torch.Tensor) -> torch.Tensor:  # [1, T, H, D] -> [Hkv, G, T, D]
            return x[0].transpose(0, 1).reshape(kv_heads, heads // kv_heads, length, dim)

        qg, d_out, out = q[0].reshape(kv_heads, heads // kv_heads, length, dim), grouped(grad_output), grouped(output)
        dq = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k[0], v[0]])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # accumulators of the block held
        dkv_works, received_dkv = [], None
        for step in range(sp_size):
            if step + 1 < sp_size:
                (next_kv,), kv_works = _ring_send_recv([kv], group)
            block_dkv = torch.zeros_like(dkv)
            for rows, cols, causal in pieces[step]:
                d_q, d_k, d_v = blocks.backward(
                    d_out[:, :, rows], qg[:, :, rows], kv[0, :, cols], kv[1, :, cols], out[:, :, rows],
                    lse[:, :, rows], causal, scale, next(states),
                )
                dq[:, :, rows] += d_q
                block_dkv[0, :, cols] += d_k
                block_dkv[1, :, cols] += d_v
            # The accumulator of block (r − step) arrives from rank r − 1, which held that block last step.
            _wait(dkv_works)
            if step > 0:
                dkv = received_dkv
            dkv = dkv + block_dkv
            if sp_size > 1:
                # Passed on every step, the last one included: after sp passes it is back at its owner.
                (received_dkv,), dkv_works = _ring_send_recv([dkv], group)
            if step + 1 < sp_size:
                _wait(kv_works)
                kv = next_kv
        if sp_size > 1:
            _wait(dkv_works)
            dkv = received_dkv
        d_q = dq.reshape(heads, length, dim).unsqueeze(0).to(q.dtype)
        return d_q, dkv[0].unsqueeze(0).to(k.dtype), dkv[1].unsqueeze(0).to(v.dtype), None, None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    local_cu_seqlens: torch.Tensor,
    group: dist.ProcessGroup,
    scaling: float | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Causal attention within each sequence of a zigzag-split packed row, as on the whole row.

    query [1, H, T_local, D], key/value [1, H_kv, T_local, D] (H a multiple of H_kv) in this rank's
    zigzag layout; `local_cu_seqlens` from `zigzag_cu_seqlens`. Returns [1, T_local, H, D] in the
    input dtype (transformers' attention output layout). Differentiable w.r.t. query, key, value.
    Every rank of `group` must call it with the same local_cu_seqlens.

    `kernel`: "torch" (each piece from materialised float32 scores, anywhere: the reference),
    "fused" (each piece through torch's fused flash kernel: CPU, or CUDA in fp16/bf16 with head
    dim <= 256), "flash" (ring-flash-attn's zigzag varlen kernel: CUDA, fp16/bf16,
    `pip install ring-flash-attn`), or "auto" (the first of flash, fused, torch that can run).
    """
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4:
        shapes = f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        raise ValueError(f"expected query [1, H, T, D] and key/value [1, H_kv, T, D], got {shapes}")
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise ValueError(f"ring attention takes packed rows of batch size 1, got {query.shape[0]}")
    if query.shape[2:] != key.shape[2:] or query.shape[1] % key.shape[1] != 0:
        raise ValueError(f"query {tuple(query.shape)} does not match key/value {tuple(key.shape)}")
    # Read once on the host: the checks, and the ring's pieces (slices of the local row) without a
    # device sync inside the ring.
    bounds = _check_cu_seqlens(local_cu_seqlens, query.shape[2])
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    if any(n % 2 for n in lengths):
        raise ValueError(f"{bounds} are not zigzag local cu_seqlens (odd sequence length)")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    kernel = ring_kernel(query, kernel)
    if kernel == "flash":
        # Same zigzag layout (chunks r and 2·sp−1−r of each sequence), tokens-first tensors.
        out = _flash_kernel()(
            query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
            local_cu_seqlens.to(device=query.device, dtype=torch.int32), max(lengths, default=0),
            softmax_scale=scale, causal=True, group=group,
        )
        return out.unsqueeze(0)
    blocks = FusedBlocks if kernel == "fused" else TorchBlocks
    return _RingAttention.apply(query, key, value, bounds, group, scale, blocks)


RING_KERNELS = ("auto", "torch", "fused", "flash")


def ring_kernel(query: torch.Tensor, requested: str = "auto") -> str:
    """The ring kernel `requested` resolves to for `query`'s device and dtype; an error says what an
    explicit choice that cannot run needs."""
    if requested not in RING_KERNELS:
        raise ValueError(f"kernel must be one of {RING_KERNELS}, got {requested!r}")
    flash = query.is_cuda and query.dtype != torch.float32 and _flash_kernel() is not None
    if requested == "flash" and not flash:
        raise RuntimeError("kernel='flash' needs CUDA, fp16/bf16 inputs and the ring-flash-attn package")
    if requested == "fused" and not FusedBlocks.supports(query):
        raise RuntimeError("kernel='fused' needs CPU, or CUDA with fp16/bf16 inputs and head dim <= 256")
    if requested != "auto":
        return requested
    return "flash" if flash else "fused" if FusedBlocks.supports(query) else "torch"


def _flash_kernel():
    """ring-flash-attn's zigzag varlen function when installed (and CUDA is there), else None."""
    if not torch.cuda.is_available() or importlib.util.find_spec("ring_flash_attn") is None:
        return None
    from ring_flash_attn import zigzag_ring_flash_attn_varlen_func

    return zigzag_ring_flash_attn_varlen_func


# ---------------------------------------------------------------------------------------------
# transformers wiring
# ---------------------------------------------------------------------------------------------


def _ring_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    group: dist.ProcessGroup,
    cu_seq_lens_q: torch.Tensor | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ring attention over `group` (bound by the registration)."""
    if cu_seq_lens_q is None:
        raise ValueError(
            "ring attention needs the local cu_seqlens: call the model with "
            "cu_seq_lens_q=zigzag_cu_seqlens(cu_seqlens, sp) (and cu_seq_lens_k, the same)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"ring attention takes packed rows of batch size 1, got {query.shape[0]}")
    if dropout != 0.0:
        raise ValueError(f"ring attention does not support attention dropout (got {dropout})")
    if sliding_window is not None:
        raise ValueError(f"ring attention does not support sliding-window attention (got {sliding_window})")
    if s_aux is not None:
        raise ValueError("ring attention does not support attention sinks (s_aux, gpt-oss)")
    if attention_mask is not None:
        raise ValueError("ring attention takes no attention_mask: sequence boundaries come from cu_seq_lens_q")
    return ring_attention(query, key, value, cu_seq_lens_q, group, scaling), None


def ring_attention_implementation(group: dist.ProcessGroup) -> str:
    """Register ring attention over `group` in transformers' attention registry; returns its name.

    Set `model.config._attn_implementation` to the name and call the model with
    `cu_seq_lens_q` (see the module docstring). Registering again (same group) rebinds the same
    name, so it is idempotent.
    """
    name = f"rl2_ring_{group.group_name}"
    AttentionInterface.register(name, functools.partial(_ring_attention_forward, group=group))
    AttentionMaskInterface.register(name, no_dense_mask)
    return name
