"""Ring attention on CPU: activation memory and time per token, sp=1 against sp=2 (gloo), one attention layer.

Each (layout, length) runs forward + backward of one attention layer (random q/k/v for one packed
row) in fresh processes: `python` for sp=1, `torchrun --nproc_per_node=2` for sp=2. Layouts:
  varlen      rl2's varlen attention (per-sequence sdpa; on CPU a flash-style kernel, O(T) memory)
  ring sp=1   rl2.distributed.ring_attention on a one-rank group (same kernel as sp=2, no communication)
  ring sp=2   rl2.distributed.ring_attention on 2 ranks, zigzag split
each ring with each of `--kernels`: torch (every piece from materialised float32 scores) and fused
(every piece through torch's flash kernel, given the global output and log-sum-exp in backward).
Memory, per rank (the worst rank):
  saved     bytes of the tensors autograd keeps between forward and backward, summed by
            `torch.autograd.graph.saved_tensors_hooks` (deterministic; inputs that are saved count)
  peak      peak RSS rise over one forward + backward (`resource.getrusage` max RSS minus the RSS
            just before; includes the transient per-sequence score blocks, [H, T_local, T_local]
            for a row of one sequence)
peak/ring1: peak relative to the torch ring at sp=1 at the same length.
Time: median wall seconds of forward + backward over the repeats, per 1k tokens of the whole row.
Both layouts use all cores: sp=1 one process with N threads, sp=2 two processes with N/2 each.

    python bench/ring_attention.py [--lengths 1024 2048 4096 8192 --sequences 1 --heads 8 --kv-heads 2]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def worker(args: argparse.Namespace) -> None:
    from rl2.distributed.process_group import exit_process, init_distributed
    from rl2.distributed.ring_attention import ring_attention, zigzag_cu_seqlens, zigzag_split
    from rl2.kernels.attention import varlen_attention

    init_distributed()
    group, rank, sp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // sp))

    def inputs(total: int):
        lengths = [total // args.sequences] * args.sequences
        lengths[-1] += total - sum(lengths)
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        gen = torch.Generator().manual_seed(0)
        full = [torch.randn(1, h, total, args.head_dim, generator=gen) for h in (args.heads, args.kv_heads, args.kv_heads)]
        local = [zigzag_split(x.transpose(1, 2), cu, rank, sp).transpose(1, 2).contiguous() for x in full]
        return cu, (full if args.layout == "varlen" else local)

    def step(cu, qkv) -> int:
        """Forward + backward; returns the bytes autograd saved for backward."""
        saved = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal saved
            saved += t.numel() * t.element_size()
            return t

        qkv = [x.detach().requires_grad_() for x in qkv]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if args.layout == "varlen":
                out, _ = varlen_attention(None, *qkv, None, cu_seq_lens_q=cu)
            else:
                out = ring_attention(*qkv, zigzag_cu_seqlens(cu, sp), group, kernel=args.kernel)
        out.backward(torch.ones_like(out))
        return saved

    step(*inputs(256))  # warm-up at a small size: thread pools, first-call allocations
    cu, qkv = inputs(args.length)
    dist.barrier()
    before = rss_bytes()
    saved = step(cu, qkv)
    peak = max(0, max_rss_bytes() - before)
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        step(cu, qkv)
        dist.barrier()
        times.append(time.perf_counter() - start)
    worst = torch.tensor([saved, peak], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        print("RESULT " + json.dumps({
            "layout": args.layout, "kernel": args.kernel, "sp": sp, "tokens": args.length, "threads_per_rank": torch.get_num_threads(),
            "saved_mib": worst[0].item() / 2**20, "peak_mib": worst[1].item() / 2**20,
            "seconds": statistics.median(times),
        }), flush=True)
    exit_process(0)


def launch(args: argparse.Namespace, layout: str, sp: int, length: int, kernel: str = "torch") -> dict:
    flags = [
        os.path.abspath(__file__), "--worker", "--layout", layout, "--length", str(length), "--kernel", kernel,
        "--sequences", str(args.sequences), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
        "--head-dim", str(args.head_dim), "--repeats", str(args.repeats),
    ]
    launcher = [sys.executable]
    if sp > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={sp}"]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // sp))}
    result = subprocess.run(launcher + flags, capture_output=True, text=True, env=env, cwd=REPO)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{layout} sp={sp} length={length} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return json.loads(lines[0][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--sequences", type=int, default=1, help="sequences in the packed row (equal lengths)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kernels", nargs="+", default=["torch", "fused"], choices=["torch", "fused"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kernel", default="torch", help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=["varlen", "ring"], default="ring", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    print(f"one attention layer, fp32 CPU, {os.cpu_count()} cores; {args.heads} query heads, {args.kv_heads} KV heads, "
          f"head dim {args.head_dim}; {args.sequences} sequence(s) per row; forward + backward, median of {args.repeats}")
    print(f"{'tokens':>6} {'layout':<16} {'thr':>3} {'saved MiB':>10} {'peak MiB':>9} {'s/step':>7} "
          f"{'ms/1k tok':>9} {'peak/ring1':>10}")
    results = []
    for length in args.lengths:
        rows = [launch(args, "varlen", 1, length)]
        rows += [launch(args, "ring", sp, length, kernel) for kernel in args.kernels for sp in (1, 2)]
        for row in rows:
            name = "varlen" if row["layout"] == "varlen" else f"ring {row['kernel']} sp={row['sp']}"
            ratio = row["peak_mib"] / rows[1]["peak_mib"] if rows[1]["peak_mib"] else float("nan")
            print(f"{length:>6} {name:<16} {row['threads_per_rank']:>3} {row['saved_mib']:>10.1f} {row['peak_mib']:>9.1f} "
                  f"{row['seconds']:>7.3f} {1000 * row['seconds'] / length * 1000:>9.1f} {ratio:>10.2f}", flush=True)
        results += rows
    print(json.dumps({"benchmark": "ring_attention", "heads": args.heads, "kv_heads": args.kv_heads,
                      "head_dim": args.head_dim, "sequences": args.sequences, "results": results}))


if __name__ == "__main__":
    main()
