"""LoRA against full fine-tuning, measured through rl2's own actor (1 rank, gloo, CPU): trainable parameters,
the bytes of parameters, gradients and optimizer state, the peak memory of training steps and the step time,
for full fine-tuning and LoRA ranks 8, 32 and 128 at Qwen2.5-1.5B's shape.

The model has the 1.5B shape (hidden 1536, intermediate 8960, 12 query / 2 KV heads, vocabulary 151,936,
tied embeddings) with `--layers` of its 28 decoder layers (default 4: full fine-tuning of all 28 in fp32 with
AdamW holds ~25 GB, over this machine's 24 GiB); the per-layer terms scale to 28 layers, printed on paper
beside the measurement. `actor.dtype=bfloat16`, checkpointing on, `--tokens` tokens per step. Each
configuration runs in its own process; its peak is the resident-set high-water mark over the timed steps,
reset after loading (`/proc/self/clear_refs`), so rank 0's one-time full copy at load does not count.

    python bench/lora_memory.py [--layers 4] [--tokens 128] [--steps 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANKS = [0, 8, 32, 128]  # 0 = full fine-tuning
SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
             vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096)
FULL_LAYERS = 28


def build_model(folder: str, layers: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **SHAPE)).save_pretrained(folder)


def resident_peak_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def measure(model_dir: str, rank: int, tokens: int, steps: int) -> dict:
    """One configuration, in this process."""
    import torch

    from rl2.algorithms.losses import sft_loss, with_loss_weights
    from rl2.config import LoraConfig, ModelConfig
    from rl2.distributed.process_group import init_distributed
    from rl2.workers.policy import Policy

    init_distributed()
    config = ModelConfig(model_name=model_dir, dtype="bfloat16", gradient_checkpointing=True, lr=1e-5,
                         max_length_per_device=tokens, lora=LoraConfig(rank=rank, alpha=2.0 * rank))
    actor = Policy(config, total_steps=steps + 1)
    generator = torch.Generator().manual_seed(0)
    batch = with_loss_weights([{"input_ids": torch.randint(0, SHAPE["vocab_size"], (tokens,), generator=generator),
                                "loss_mask": torch.ones(tokens, dtype=torch.long)}])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the resident high-water mark: the load's full copy is not the step's
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        actor.train_step(batch, sft_loss)
        times.append(time.perf_counter() - start)
    trainable = [p for p in actor.model.parameters() if p.requires_grad]
    optimizer_bytes = sum(t.numel() * t.element_size() for state in actor.optimizer.state.values()
                          for t in state.values() if isinstance(t, torch.Tensor))
    return {
        "rank": rank, "trainable": sum(p.numel() for p in trainable),
        "params": sum(p.numel() for p in actor.model.parameters()),
        "param_bytes": sum(p.numel() * p.element_size() for p in actor.model.parameters()),
        "grad_bytes": sum(p.numel() * 4 for p in trainable),  # fp32 gradients of what trains
        "optimizer_bytes": optimizer_bytes, "peak_bytes": resident_peak_bytes(),
        "step_seconds": statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("MODEL_DIR", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.tokens, args.steps)))
        return
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder, args.layers)
        results = []
        for rank in RANKS:
            env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled"}
            out = subprocess.run([sys.executable, __file__, "--one", folder, str(rank), "--tokens", str(args.tokens),
                                  "--steps", str(args.steps)], capture_output=True, text=True, env=env, check=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    gib = 2**30
    print(f"Qwen2.5-1.5B shape, {args.layers} of {FULL_LAYERS} layers, bf16 compute, checkpointing, {args.tokens} tokens a step")
    print(f"{'run':>9} {'trainable':>11} {'params GiB':>10} {'grads GiB':>9} {'optim GiB':>9} {'peak GiB':>8} "
          f"{'step s':>6} | 28 layers: {'trainable':>11} {'state GiB':>9}")
    full = results[0]
    for r in results:
        name = "full" if r["rank"] == 0 else f"LoRA {r['rank']}"
        # 28 layers on paper: the layer terms scale, the embedding (one tied matrix) does not.
        embedding = SHAPE["vocab_size"] * SHAPE["hidden_size"]
        scale = FULL_LAYERS / args.layers
        trainable_28 = (r["trainable"] - (embedding if r["rank"] == 0 else 0)) * scale + (embedding if r["rank"] == 0 else 0)
        base_bytes_per_param = 4 if r["rank"] == 0 else 2
        params_28 = (full["params"] - embedding) * scale + embedding
        state_28 = (params_28 * base_bytes_per_param + trainable_28 * (4 + 8 + (0 if r["rank"] == 0 else 4))) / gib
        print(f"{name:>9} {r['trainable']:>11,} {r['param_bytes'] / gib:>10.2f} {r['grad_bytes'] / gib:>9.2f} "
              f"{r['optimizer_bytes'] / gib:>9.2f} {r['peak_bytes'] / gib:>8.2f} {r['step_seconds']:>6.1f} | "
              f"{'':>10} {trainable_28:>11,.0f} {state_28:>9.2f}")
    for r in results[1:]:
        print(f"LoRA {r['rank']}: {r['peak_bytes'] / full['peak_bytes']:.2f}x full's peak, "
              f"{r['step_seconds'] / full['step_seconds']:.2f}x its step time, "
              f"{r['optimizer_bytes'] / full['optimizer_bytes']:.4f}x its optimizer state")


if __name__ == "__main__":
    main()
