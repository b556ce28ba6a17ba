"""Policy training throughput at GPU scale: rl2's `Policy.train_step` against the loop a user would write,
same model, data and run.

The plain loop: the Hugging Face model with sdpa attention, bf16 autocast over fp32 weights, AdamW,
sequences sorted by length and padded into micro-batches of at most `--max-tokens` padded tokens,
log-probs from full logits. rl2: FSDP2 (one rank), bf16 compute over fp32 master weights, balanced
packed rows of at most `--max-tokens` tokens, packed-row attention (`actor.attn_implementation=auto`),
log-probs from the LM head in chunks. Both train on the same long-tailed batch (RL response lengths),
with activation checkpointing on and off; only real tokens count. Also timed: `Policy.compute`
(no-grad forward over the same tokens) as a share of the train step.

MFU = (6 × matmul parameters × tokens + causal attention FLOPs) / time / peak, with attention at
6 × layers × query width × Σ L² per step (forward 2·L²·width halved by the causal mask, backward twice
that); recomputation under checkpointing is not counted. Peak: 989 TFLOP/s (H100 SXM dense bf16) on
CUDA; on CPU no MFU is printed.

    python bench/gpu_train.py [--shapes 0.5b 1.5b] [--tokens 68800] [--max-tokens 16384] [--steps 3]
    python bench/gpu_train.py --shapes tiny --tokens 4000 --max-tokens 1024 --steps 1   # CPU

With `--profile` one more rl2 train step runs under `torch.profiler`: the device's busy share of the
step's wall time, its kernel time by kind (matmul, attention, the log-prob head's softmax work,
other elementwise, optimizer, copies) and the costliest kernels.
"""

import argparse
import gc
import resource
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rl2.algorithms.losses import sft_loss, with_loss_weights
from rl2.config import ModelConfig
from rl2.distributed.fsdp import enable_activation_checkpointing
from rl2.distributed.process_group import init_distributed
from rl2.workers.policy import Policy

H100_BF16_PEAK = 989e12

# Qwen2.5 shapes with their 151,936-token vocabulary (random init: throughput does not depend on weights).
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096),
}


def save_shape(shape: str, folder: str) -> Qwen2Config:
    config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=32768)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return config


def rl_batch(total_tokens: int, vocab_size: int, max_length: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences of a prompt (64..512 tokens) and a long-tailed response (log-normal, capped), up to
    `total_tokens` in all; the loss is on the response."""
    generator = torch.Generator().manual_seed(seed)
    batch, total = [], 0
    while total < total_tokens:
        prompt = int(torch.randint(64, 513, (1,), generator=generator))
        response = int((6.5 + 1.0 * torch.randn(1, generator=generator)).exp().clamp(16, max_length - prompt))
        length = min(prompt + response, total_tokens - total, max_length)
        if length < 2:
            break
        loss_mask = torch.zeros(length, dtype=torch.long)
        loss_mask[min(prompt, length - 1):] = 1
        batch.append({"input_ids": torch.randint(0, vocab_size, (length,), generator=generator), "loss_mask": loss_mask})
        total += length
    return batch


def step_flops(config: Qwen2Config, lengths: list[int]) -> float:
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * hidden * 2 + hidden * kv * 2 + 3 * hidden * config.intermediate_size  # q, o, k, v, MLP
    matmul_params = layers * per_layer + config.vocab_size * hidden  # the LM head is a matmul too
    attention = 6 * layers * config.num_attention_heads * head_dim * sum(n * n for n in lengths)
    return 6 * matmul_params * sum(lengths) + attention


class Memory:
    """Peak memory of what runs between `reset` and `peak_gib`: CUDA allocations, or on CPU the
    process's peak RSS (which never falls: there it only shows the largest run so far)."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(step, steps: int, device: torch.device) -> float:
    """Seconds per step, median of `steps` after one warm-up."""
    step()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


KERNEL_KINDS = (  # first match wins; names as CUDA kernels and CPU ops are called
    ("matmul", ("gemm", "matmul", "nvjet", "cutlass", "sm90_xmma", "aten::mm", "aten::addmm", "aten::bmm", "linear")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("copies/casts", ("memcpy", "memset", "copy", "to_copy", "cast", "nccl", "all_gather", "reduce_scatter")),
    ("softmax/reductions", ("logsumexp", "softmax", "reduce", "exp", "vecdot", "gather", "scatter")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(key in lowered for key in keys)), "other elementwise")


def profile_step(step, device: torch.device, label: str, top: int = 18) -> None:
    """One `step` under torch.profiler: wall time, the device's busy share, kernel time by kind, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        sync(device)
    wall = time.perf_counter() - start
    kernel_type = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == kernel_type and e.self_device_time_total > 0] \
        if device.type == "cuda" else [e for e in prof.key_averages() if e.self_cpu_time_total > 0 and e.cpu_children == []]
    own = (lambda e: e.self_device_time_total) if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
    busy = sum(own(e) for e in events) / 1e6
    print(f"profile {label}: wall {wall:.3f} s, kernels {busy:.3f} s ({busy / wall:.0%} of wall)")
    kinds: dict[str, float] = {}
    for event in events:
        kinds[kernel_kind(event.key)] = kinds.get(kernel_kind(event.key), 0.0) + own(event) / 1e6
    for kind, seconds in sorted(kinds.items(), key=lambda item: -item[1]):
        print(f"  {kind:20} {seconds:7.3f} s {seconds / busy:6.1%}")
    for event in sorted(events, key=own, reverse=True)[:top]:
        print(f"  {own(event) / 1e3:9.1f} ms {event.count:6d}x  {kernel_kind(event.key)[:10]:10} {event.key[:110]}")


def run_rl2(folder, batch, args, checkpointing: bool, device: torch.device) -> dict:
    config = ModelConfig(
        model_name=folder, dtype="bfloat16" if device.type == "cuda" else "float32", lr=1e-5,
        gradient_checkpointing=checkpointing, max_length_per_device=args.max_tokens,
        attn_implementation=args.attention, logps_chunk_size=args.logps_chunk_size, compile=args.compile,
    )
    actor = Policy(config, total_steps=1000)
    weighted = with_loss_weights(batch)
    train = timed_steps(lambda: actor.train_step(weighted, sft_loss), args.steps, device)
    logps = timed_steps(lambda: actor.compute(batch), args.steps, device)
    if args.profile:
        profile_step(lambda: actor.train_step(weighted, sft_loss), device, f"rl2 train step, checkpointing {checkpointing}")
    return {"seconds": train, "logps_seconds": logps}


def run_plain(folder, batch, args, checkpointing: bool, device: torch.device) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").to(device)
    if checkpointing:
        enable_activation_checkpointing(model)
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ordered = sorted(batch, key=lambda s: len(s["input_ids"]))
    micro_batches, current = [], []
    for sequence in ordered:  # length-grouped: each micro-batch padded to its longest, <= max_tokens padded tokens
        width = len(sequence["input_ids"])
        if current and width * (len(current) + 1) > args.max_tokens:
            micro_batches.append(current)
            current = []
        current.append(sequence)
    micro_batches.append(current)
    tokens = sum(s["loss_mask"].sum() for s in batch)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        model.train()
        for chunk in micro_batches:
            width = max(len(s["input_ids"]) for s in chunk)
            input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
            attention_mask = torch.zeros(len(chunk), width, dtype=torch.long)
            loss_mask = torch.zeros(len(chunk), width)
            for i, s in enumerate(chunk):
                n = len(s["input_ids"])
                input_ids[i, :n], attention_mask[i, :n], loss_mask[i, :n] = s["input_ids"], 1, s["loss_mask"]
            input_ids, attention_mask, loss_mask = input_ids.to(device), attention_mask.to(device), loss_mask.to(device)
            with autocast:
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None])[..., 0]
            (-(logps * loss_mask[:, 1:]).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds = timed_steps(step, args.steps, device)
    return {"seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"], choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=68800, help="tokens per training step")
    parser.add_argument("--max-tokens", type=int, default=16384, help="tokens per micro-batch (padded tokens for the plain loop)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement (after one warm-up)")
    parser.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--methods", nargs="+", default=["plain", "rl2"], choices=["plain", "rl2"])
    parser.add_argument("--attention", default="auto", help="actor.attn_implementation")
    parser.add_argument("--logps-chunk-size", type=int, default=2048, help="actor.logps_chunk_size")
    parser.add_argument("--compile", action="store_true", help="actor.compile")
    parser.add_argument("--profile", action="store_true", help="profile one more rl2 train step")
    args = parser.parse_args()
    init_distributed()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    memory = Memory(device)
    peak = H100_BF16_PEAK if device.type == "cuda" else None
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"device: {name}; MFU against {peak / 1e12:.0f} TFLOP/s (H100 SXM dense bf16)" if peak else f"device: {name}")
    print(f"{'shape':6} {'ckpt':4} {'method':6} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'step s':>7} {'logps/step':>10}")
    for shape in args.shapes:
        with tempfile.TemporaryDirectory() as folder:
            config = save_shape(shape, folder)
            batch = rl_batch(args.tokens, config.vocab_size, args.max_tokens)
            lengths = [len(s["input_ids"]) for s in batch]
            flops = step_flops(config, lengths)
            for checkpointing in args.checkpointing:
                results = {}
                for method in args.methods:
                    memory.reset()
                    run = run_rl2 if method == "rl2" else run_plain
                    try:
                        result = run(folder, batch, args, checkpointing == "on", device)
                    except torch.OutOfMemoryError as error:
                        print(f"{shape:6} {checkpointing:4} {method:6} out of memory: {str(error).splitlines()[0][:100]}")
                        continue
                    result["peak"] = memory.peak_gib()
                    results[method] = result
                    tokens_per_s = sum(lengths) / result["seconds"]
                    mfu = f"{flops / result['seconds'] / peak:.1%}" if peak else "-"
                    logps = f"{result['logps_seconds'] / result['seconds']:.2f}x" if "logps_seconds" in result else "-"
                    print(f"{shape:6} {checkpointing:4} {method:6} {tokens_per_s:10.0f} {mfu:>6} {result['peak']:9.2f} "
                          f"{result['seconds']:7.3f} {logps:>10}", flush=True)
                if len(results) == 2:
                    ratio = results["plain"]["seconds"] / results["rl2"]["seconds"]
                    print(f"{shape:6} {checkpointing:4} rl2 / plain tokens/s: {ratio:.2f}x", flush=True)
    print(f"batch: {len(lengths)} sequences, {sum(lengths)} tokens (longest {max(lengths)}), "
          f"micro-batches of <= {args.max_tokens} tokens")


if __name__ == "__main__":
    main()
