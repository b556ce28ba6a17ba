"""Correctness of the code paths that only run on a GPU, against references computed in float64: the
first thing to run on a lent GPU, before timing anything.

- `varlen`: torch's variable-length attention (`torch_varlen_attention`), output and gradients, on a
  packed row of sequences;
- `varlen, keys longer`: the same kernel with each sequence's keys longer than its queries (the hf
  engine's prefill after a cached prefix): the causal mask must be aligned to the end of the keys;
- `ring pieces`: `FusedBlocks` (torch's flash kernel per ring piece), a query block against two key
  pieces merged by log-sum-exp, and the backward of each piece given the merged output and
  log-sum-exp, against dense attention;
- `ring sp=1`: `ring_attention` with each kernel on a one-rank group, output and gradients;
- `engine`: the hf engine's log-probs of its own samples against a plain forward of the same model,
  per prefill attention and with CUDA graphs on and off, with shared prompts and a second turn
  (prefill after cached prefixes);
- `engine hybrid`: the same on a tiny Qwen3-Next (gated delta-nets beside full attention: the linear-attention
  states kept per slot, `rl2/engines/linear_attention_slots.py`; graphs must not advance them at their warm-ups).
- `engine routes`: the experts the hf engine records for a tiny MoE's samples (R3), in float32, against a plain
  forward's over each sample: the share of decisions that differ, per prefill attention and with CUDA graphs on
  and off (the captured decode writes them too).

Each line prints the worst error and its tolerance; the exit status is 1 if any check fails. On
CPU the same checks run in float32 with what CPU has (the engine's loop; the fused ring
pieces through the CPU flash kernel), so the script can be tried anywhere.

    python bench/gpu_checks.py
"""

import argparse
import functools
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_train import save_shape  # noqa: E402

from rl2.distributed.ring_attention import FusedBlocks, ring_attention, zigzag_cu_seqlens  # noqa: E402
from rl2.engines import HFEngine, SamplingParams  # noqa: E402
from rl2.kernels.attention import available_attention, torch_varlen_attention  # noqa: E402
from rl2.models.routing_replay import RoutingReplay, routing_mismatch  # noqa: E402
from rl2.testing.tiny_moe import save_tiny_moe  # noqa: E402
from rl2.testing.tiny import build_tiny_tokenizer, sharpen_weights  # noqa: E402


def dense(q, k, v, q_bounds, k_bounds, scale):
    """Causal attention per sequence, aligned to the end of its keys; [1, H, T, D] in, [1, T, H, D] out."""
    outputs = []
    group = q.shape[1] // k.shape[1]
    for (qa, qb), (ka, kb) in zip(zip(q_bounds, q_bounds[1:]), zip(k_bounds, k_bounds[1:])):
        visible = torch.arange(kb - ka, device=q.device)[None] <= torch.arange(qb - qa, device=q.device)[:, None] + (
            (kb - ka) - (qb - qa))
        keys, values = (x[:, :, ka:kb].repeat_interleave(group, dim=1) for x in (k, v))
        outputs.append(F.scaled_dot_product_attention(q[:, :, qa:qb], keys, values, attn_mask=visible, scale=scale))
    return torch.cat(outputs, dim=2).transpose(1, 2)


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest error relative to the reference's largest value."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def random_qkv(total_q: int, total_k: int, device, dtype, heads=8, kv_heads=2, dim=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, total_q, dim, generator=generator)
    k, v = (torch.randn(1, kv_heads, total_k, dim, generator=generator) for _ in range(2))
    return [x.to(device, dtype).requires_grad_() for x in (q, k, v)]


def check_varlen(device, dtype, keys_longer: bool) -> float:
    q_lengths = [37, 1, 300, 64]
    k_lengths = [n + extra for n, extra in zip(q_lengths, (100, 5, 0, 700))] if keys_longer else q_lengths
    q_bounds = [0, *torch.tensor(q_lengths).cumsum(0).tolist()]
    k_bounds = [0, *torch.tensor(k_lengths).cumsum(0).tolist()]
    q, k, v = random_qkv(q_bounds[-1], k_bounds[-1], device, dtype)
    as_cu = lambda bounds: torch.tensor(bounds, dtype=torch.int32, device=device)  # noqa: E731
    out, _ = torch_varlen_attention(None, q, k, v, None, 0.125, cu_seq_lens_q=as_cu(q_bounds),
                                    cu_seq_lens_k=as_cu(k_bounds))
    grad = torch.randn_like(out)
    out.backward(grad)
    reference = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = dense(*reference, q_bounds, k_bounds, 0.125)
    expected.backward(grad.double())
    return max([worst(out, expected)] + [worst(x.grad, r.grad) for x, r in zip((q, k, v), reference)])


def check_ring_pieces(device, dtype) -> float:
    """Queries [0, 96) against keys [0, 160): keys [0, 64) as a full piece, [64, 160) as a causal one
    (the last 96 keys against the 96 queries), merged as the ring merges them."""
    q, k, v = random_qkv(96, 160, device, dtype)
    grouped_q = q[0].reshape(2, 4, 96, 64)
    pieces = [(slice(0, 64), False), (slice(64, 160), True)]
    results = [FusedBlocks.forward(grouped_q, k[0, :, cols], v[0, :, cols], causal, 0.125) for cols, causal in pieces]
    lse = torch.logaddexp(results[0][1], results[1][1])
    out = sum(torch.exp(block_lse - lse)[..., None] * block_out for block_out, block_lse, _ in results)
    grad = torch.randn_like(out)
    d_q = torch.zeros_like(out)
    d_k, d_v = torch.zeros(2, 160, 64, device=device), torch.zeros(2, 160, 64, device=device)
    for (cols, causal), (_, _, state) in zip(pieces, results):
        piece = FusedBlocks.backward(grad, grouped_q, k[0, :, cols], v[0, :, cols], out, lse, causal, 0.125, state)
        d_q += piece[0]
        d_k[:, cols] += piece[1]
        d_v[:, cols] += piece[2]
    reference = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = dense(*reference, [0, 96], [0, 160], 0.125)  # causal aligned to the end: the same mask
    expected.backward(grad.double().reshape(1, 8, 96, 64).transpose(1, 2))
    got = out.reshape(1, 8, 96, 64).transpose(1, 2)
    return max(worst(got, expected), worst(d_q.reshape(1, 8, 96, 64), reference[0].grad),
               worst(d_k[None], reference[1].grad), worst(d_v[None], reference[2].grad))


def check_ring(device, dtype, kernel: str) -> float:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29541", rank=0, world_size=1)
    lengths = [37, 1, 300, 64]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    local_cu = zigzag_cu_seqlens(cu, 1)
    total = int(local_cu[-1])
    q, k, v = random_qkv(total, total, device, dtype, seed=1)
    out = ring_attention(q, k, v, local_cu, dist.group.WORLD, kernel=kernel)
    grad = torch.randn_like(out)
    out.backward(grad)
    bounds = local_cu.tolist()
    reference = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected = dense(*reference, bounds, bounds, 64 ** -0.5)
    expected.backward(grad.double())
    return max([worst(out, expected)] + [worst(x.grad, r.grad) for x, r in zip((q, k, v), reference)])


def check_engine(folder: str, device, dtype: str, attention: str, cuda_graphs: bool) -> float:
    """The largest |log-prob difference| between the engine's samples and a plain forward."""
    tokenizer = build_tiny_tokenizer()
    engine = HFEngine(folder, tokenizer, device, dtype=dtype, seed=0, max_batch_size=16, cuda_graphs=cuda_graphs,
                      attn_implementation=attention)
    vocab = min(4000, engine.model.get_input_embeddings().num_embeddings)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (40, 70, 5, 130)]
    prompts = [p for p in prompts for _ in range(3)]  # copies prefill after the shared prefix
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    answers = engine.generate(prompts, params)
    second = [p + a.token_ids + [7, 8, 9] for p, a in zip(prompts, answers)]  # prefill after the kept caches
    error = 0.0
    for prompt, generation in list(zip(prompts, answers)) + list(zip(second, engine.generate(second, params))):
        ids = torch.tensor([prompt + generation.token_ids], device=device)
        with torch.no_grad():
            logits = engine.model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(generation.token_ids, device=device)[:, None])
        error = max(error, (expected[:, 0].cpu() - torch.tensor(generation.logprobs)).abs().max().item())
    return error


def check_engine_routes(folder: str, device, attention: str, cuda_graphs: bool) -> float:
    """The share of the engine's recorded routing decisions (fp32) that a plain forward over the sample makes
    otherwise."""
    from transformers import AutoTokenizer

    engine = HFEngine(folder, AutoTokenizer.from_pretrained(folder), device, dtype="float32", seed=0, max_batch_size=4,
                      cuda_graphs=cuda_graphs, attn_implementation=attention, record_routes=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (40, 70, 5, 33)]
    prompts = [p for p in prompts for _ in range(3)]  # shared prefixes, more requests than slots
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=list(range(3, 60)))
    changed = []
    with RoutingReplay(engine.model) as replay, torch.no_grad():
        for prompt, generation in zip(prompts, engine.generate(prompts, params)):
            replay.record()
            engine.model(input_ids=torch.tensor([prompt + generation.token_ids], device=device), use_cache=False)
            changed.append(routing_mismatch(replay.routes()[:, :-1].cpu(), generation.routes.transpose(0, 1)))
    engine.shutdown()
    return max(changed)


def save_peaked_tiny_model(folder: str) -> None:
    """The tiny shape with larger random weights: varied, peaked next-token distributions, so a wrong
    attention mask shows in the log-probs (at the default init they are nearly uniform)."""
    save_shape("tiny", folder)
    sharpen_weights(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    # bf16 rounds inputs and outputs to 8 bits of mantissa (2^-8 ≈ 0.004 of the largest value).
    # The engine's log-probs are of a bf16 model against the same model's plain forward: the kernels
    # round differently, ~0.05 on logits of ~10 (a wrong mask moves them by more than 1).
    tolerance, logprob_tolerance = (0.03, 0.25) if cuda else (1e-5, 1e-4)
    available = available_attention(device)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}, {dtype}; "
          f"packed attention available: {', '.join(name for name, ok in available.items() if ok)}")
    checks = []
    if available["torch_varlen"]:
        checks += [("varlen", lambda: check_varlen(device, dtype, False), tolerance),
                   ("varlen, keys longer", lambda: check_varlen(device, dtype, True), tolerance)]
    if FusedBlocks.supports(torch.empty(0, device=device, dtype=dtype)):
        checks.append(("ring pieces (fused)", lambda: check_ring_pieces(device, dtype), tolerance))
    checks += [(f"ring sp=1 ({kernel})", lambda kernel=kernel: check_ring(device, dtype, kernel), tolerance)
               for kernel in ("torch", "auto")]
    engine_dtype = "bfloat16" if cuda else "float32"
    attentions = ["sdpa_loop"] + [name for name in ("torch_varlen", "flash_attention_2") if available[name]]
    graphs = [True, False] if cuda else [False]
    failed = 0
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as hybrid:
        save_peaked_tiny_model(folder)
        save_tiny_moe(hybrid, "qwen3_next")
        moe = save_tiny_moe(os.path.join(folder, "moe"), "qwen3_moe")
        for model, kind in ((folder, ""), (hybrid, " hybrid")):
            for attention in attentions:
                for cuda_graphs in graphs:
                    name = f"engine{kind} {attention}{', graphs' if cuda_graphs else ''}"
                    checks.append((name, functools.partial(check_engine, model, device, engine_dtype, attention,
                                                           cuda_graphs), logprob_tolerance))
        for attention in attentions:
            for cuda_graphs in graphs:
                # fp32 kernels differ in the last bits: a rare near-tie may flip (a misplaced route flips most)
                checks.append((f"engine routes {attention}{', graphs' if cuda_graphs else ''}",
                               functools.partial(check_engine_routes, moe, device, attention, cuda_graphs),
                               0.01 if cuda else 0.0))
        for name, check, limit in checks:
            try:
                error = check()
                ok = error <= limit
                print(f"{'PASS' if ok else 'FAIL'}  {name:<28} error {error:.2e} (tolerance {limit:.0e})", flush=True)
            except Exception as exc:  # noqa: BLE001 - reported, and the other checks still run
                ok = False
                print(f"FAIL  {name:<28} {type(exc).__name__}: {exc}", flush=True)
            failed += not ok
    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"{len(checks) - failed} of {len(checks)} checks passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
