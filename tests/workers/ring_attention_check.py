"""Ring attention against single-process varlen attention; rank 0 writes the worst errors as JSON.

Usage: ring_attention_check.py MODEL_DIR OUT_JSON   (torchrun with any nproc, or plain python for sp=1)

Every rank builds the same full packed inputs and computes the reference on the whole row itself;
the ring side runs on its zigzag split. Checks: attention output and dq/dk/dv (fp32, GQA and MHA,
lengths 1 and not divisible by 2·sp), bf16 in/out, with each ring kernel (torch, fused), zigzag_gather's backward, and a tiny Qwen2
model (logits and parameter gradients summed over the SP group) through
`ring_attention_implementation`, with and without gradient checkpointing. With 4 ranks the
attention checks also run on two SP subgroups of 2 (group ranks differ from global ranks there).
"""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from rl2.distributed.fsdp import enable_activation_checkpointing
from rl2.kernels.attention import packed_attention_implementation, varlen_attention
from rl2.distributed.process_group import exit_process, init_distributed
from rl2.distributed.ring_attention import (
    ring_attention,
    ring_attention_implementation,
    zigzag_cu_seqlens,
    zigzag_gather,
    zigzag_position_ids,
    zigzag_split,
)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def split_heads(x: torch.Tensor, cu: torch.Tensor, rank: int, sp: int) -> torch.Tensor:
    """zigzag_split of a [1, H, T, D] tensor along T."""
    return zigzag_split(x.transpose(1, 2), cu, rank, sp).transpose(1, 2)


def attention_case(
    lengths: list[int], heads: int, kv_heads: int, dim: int, seed: int, group, dtype=torch.float32, kernel="auto"
) -> dict[str, float]:
    """Errors of ring attention (output, dq, dk, dv) against varlen attention on the whole row."""
    rank, sp = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(1, h, total, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(1, total, heads, dim, generator=gen).to(dtype)

    # Reference on the whole row, in float64 from the same (possibly bf16-rounded) inputs.
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, _ = varlen_attention(None, *ref, None, cu_seq_lens_q=cu)
    ref_out.backward(grad_out.double())

    local = [split_heads(x, cu, rank, sp).requires_grad_() for x in (q, k, v)]
    out = ring_attention(*local, zigzag_cu_seqlens(cu, sp), group, kernel=kernel)
    assert out.dtype == dtype and out.shape == (1, local[0].shape[2], heads, dim), (out.dtype, out.shape)
    gathered = zigzag_gather(out, cu, group)
    (gathered.float() * grad_out.float()).sum().backward()
    errors = {"out": max_err(gathered, ref_out)}
    for name, x, r in zip(("dq", "dk", "dv"), local, ref):
        # Padding tokens must get exactly zero gradient, which the zero-padded reference split has.
        errors[name] = max_err(x.grad, split_heads(r.grad, cu, rank, sp))
    return errors


def random_lengths(n: int, seed: int, high: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(1, high, (n,), generator=gen)]


def attention_checks(group, tag: str, kernel: str) -> dict[str, float]:
    sp = dist.get_world_size(group)
    tag = f"{tag}/{kernel}"
    cases = [
        ([5, 1, 8], 4, 2, 8),
        ([1], 2, 1, 4),
        ([2 * sp * 3 + 1, 1, 2 * sp, 2 * sp - 1, 17], 4, 2, 16),
        (random_lengths(7, 1, 40) + [1], 4, 4, 8),
        (random_lengths(5, 2, 90), 6, 2, 8),
    ]
    errors: dict[str, float] = {}
    for n, (lengths, heads, kv_heads, dim) in enumerate(cases):
        for name, err in attention_case(lengths, heads, kv_heads, dim, seed=n, group=group, kernel=kernel).items():
            errors[f"{tag}/fp32/{name}"] = max(errors.get(f"{tag}/fp32/{name}", 0.0), err)
    bf16 = attention_case([33, 1, 20], 4, 2, 16, seed=7, group=group, dtype=torch.bfloat16, kernel=kernel)
    for name, err in bf16.items():
        errors[f"{tag}/bf16/{name}"] = err
    return errors


def gather_backward_check(group) -> float:
    """zigzag_gather's backward hands each rank exactly its own slice of the upstream gradient."""
    rank, sp = dist.get_rank(group), dist.get_world_size(group)
    lengths = [5, 1, 8, 2 * sp + 1]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(11)
    full = torch.randn(1, sum(lengths), 3, generator=gen)
    upstream = torch.randn(1, sum(lengths), 3, generator=gen)
    local = zigzag_split(full, cu, rank, sp).requires_grad_()
    gathered = zigzag_gather(local, cu, group)
    (gathered * upstream).sum().backward()
    return max(max_err(gathered, full), max_err(local.grad, zigzag_split(upstream, cu, rank, sp)))


def model_check(model_dir: str, group, checkpointing: bool, pass_max_lengths: bool, gather_logps: bool) -> dict[str, float]:
    """Tiny Qwen2: ring forward and SP-summed gradients against one packed row.

    Gathers either the logits ([1, T, V] on every rank) or, cheaper, per-token log-probs of the next
    token computed locally on zigzag-split targets ([1, T]).
    """
    rank, sp = dist.get_rank(group), dist.get_world_size(group)
    ref = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=packed_attention_implementation(torch.device("cpu"))
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config._attn_implementation = ring_attention_implementation(group)  # the lead's recipe
    for m in (ref, model):
        m.train()
        if checkpointing:
            enable_activation_checkpointing(m)

    gen = torch.Generator().manual_seed(3)
    lengths = [37, 1, 20, 4 * sp + 1, 64, 5]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    total, vocab = sum(lengths), model.config.vocab_size
    input_ids = torch.randint(3, vocab, (1, total), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    weights = torch.randn(1, total, generator=gen) / total  # a per-token mean, as a training loss

    next_ids = torch.roll(input_ids, -1, dims=1)  # the target of each token (meaningless at sequence ends)

    def logps_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]

    ref_logits = ref(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    ref_logps = logps_of(ref_logits, next_ids)
    (ref_logps * weights).sum().backward()

    local_cu = zigzag_cu_seqlens(cu, sp)
    kwargs = {"cu_seq_lens_q": local_cu, "cu_seq_lens_k": local_cu}
    if pass_max_lengths:
        longest = int((local_cu[1:] - local_cu[:-1]).max())
        kwargs.update(max_length_q=longest, max_length_k=longest)
    local_logits = model(
        input_ids=zigzag_split(input_ids, cu, rank, sp, pad_value=model.config.pad_token_id),
        position_ids=zigzag_position_ids(cu, rank, sp),
        use_cache=False,
        **kwargs,
    ).logits
    if gather_logps:
        local_targets = zigzag_split(next_ids, cu, rank, sp, pad_value=0)
        logps = zigzag_gather(logps_of(local_logits, local_targets), cu, group)
        errors = {"logps": max_err(logps, ref_logps)}
    else:
        logits = zigzag_gather(local_logits, cu, group)
        logps = logps_of(logits, next_ids)
        errors = {"logits": max_err(logits, ref_logits)}
    (logps * weights).sum().backward()

    # Parameter gradients span 1e-4 to 1e-1 here: each one's error is taken relative to its tensor's
    # largest element ("grads/relative"), as conftest.assert_same_gradients does.
    grad_err = 0.0
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        reference = ref_params[name].grad
        grad_err = max(grad_err, max_err(grad, reference) / reference.abs().max().item())
    errors["grads/relative"] = grad_err
    tag = f"model{'/ckpt' if checkpointing else ''}{'/local_logps' if gather_logps else ''}"
    return {f"{tag}/{name}": err for name, err in errors.items()}


def missing_cu_seqlens_raises(model_dir: str, group) -> float:
    """Calling the model without cu_seq_lens_q must fail loudly, not attend across sequences."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config._attn_implementation = ring_attention_implementation(group)
    try:
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    except ValueError as error:
        return 0.0 if "cu_seq_lens_q" in str(error) else 1.0
    return 1.0


def main() -> None:
    model_dir, out_file = sys.argv[1], sys.argv[2]
    init_distributed()
    torch.manual_seed(0)
    world = dist.group.WORLD
    errors = {}
    for kernel in ("torch", "fused"):  # each piece from materialised scores, and from torch's flash kernel
        errors.update(attention_checks(world, f"sp{dist.get_world_size()}", kernel))
    if dist.get_world_size() == 4:
        subgroups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        errors.update(attention_checks(subgroups[dist.get_rank() // 2], "sp2_subgroup", "auto"))
    errors["gather_backward"] = gather_backward_check(world)
    errors.update(model_check(model_dir, world, checkpointing=False, pass_max_lengths=False, gather_logps=False))
    errors.update(model_check(model_dir, world, checkpointing=True, pass_max_lengths=True, gather_logps=False))
    errors.update(model_check(model_dir, world, checkpointing=False, pass_max_lengths=False, gather_logps=True))
    errors["missing_cu_seqlens_raises"] = missing_cu_seqlens_raises(model_dir, world)
    assert ring_attention_implementation(world) == ring_attention_implementation(world)

    # The worst over all ranks (same keys in the same order everywhere).
    values = torch.tensor(list(errors.values()), dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(out_file, "w") as f:
            json.dump(dict(zip(errors, values.tolist())), f, indent=1)


if __name__ == "__main__":
    main()
    exit_process(0)  # see its docstring: gloo can abort a finished rank during interpreter teardown
