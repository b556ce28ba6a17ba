"""Memory per GPU of the actor's train step, on paper: Qwen2.5 7B, 14B and 32B on 8 GPUs with FSDP over all
of them, sequence parallelism sp = 1, 2, 4, at 16k and 32k tokens per GPU, activation checkpointing on.

An estimate from each term's size (bytes), not a measurement; the per-token activation term is the one
to calibrate against `bench/gpu_train.py`'s measured peaks:

- sharded state: fp32 master weights + fp32 gradients + AdamW's two fp32 moments = 16 B × params / 8;
- gathered bf16 weights: two decoder layers (the one computing and the one prefetched) + embedding and
  head (the root group stays gathered through the step);
- checkpoints: each layer's bf16 input, layers × tokens × hidden × 2 B;
- one layer recomputed in backward, with its gradients: about 2 × tokens × (2 B × (6 hidden + 2 kv width
  + 4 intermediate) + 4 B × 2 hidden) (bf16 projections and MLP activations, fp32 RMSNorm copies);
- log-probs: chunks of 2,048 tokens × vocab × (fp32 logits + fp32 exp + bf16 gradient) = 10 B each;
  the full-logits alternative holds about 4 fp32 copies of tokens × vocab;
- ring attention: K/V blocks in flight, 3 × tokens × kv width × 2 × 2 B.

With `actor.offload_optimizer` the moments live in CPU memory: state = 8 B × params / 8.

With LoRA (`actor.lora.rank` r on every linear layer of the decoder) the frozen base weights are stored in
bf16 (2 B × params / 8) and only the adapters, r × (9 hidden + 2 kv width + 3 intermediate) per layer,
have fp32 masters, gradients and moments (16 B each); activations are the same, plus the adapters' small
r-wide intermediates. A KL reference costs nothing more (the actor with adapters off), where full
fine-tuning needs a second, bf16, copy (2 B × params / 8) — not counted in the full-tuning totals above.
Sequence parallelism does not change these per-GPU figures at equal tokens per GPU: it is what lets one
sequence (a row) be sp times longer than what one GPU holds.

A GPU "fits" at 80 GiB minus 10% for the allocator's fragmentation and the CUDA context.

    python bench/memory_budget.py
"""

GIB = 2**30
GPUS = 8
USABLE_GIB = 80 * 0.9
CHUNK = 2048

# (params, hidden, layers, intermediate, query heads, kv heads, vocab, tied embeddings)
MODELS = {
    "7B": (7.62e9, 3584, 28, 18944, 28, 4, 152064, False),
    "14B": (14.77e9, 5120, 48, 13824, 40, 8, 152064, False),
    "32B": (32.76e9, 5120, 64, 27648, 40, 8, 152064, False),
}


def budget(model: str, tokens: int, sp: int, chunked: bool = True) -> dict[str, float]:
    """GiB per GPU by term for `tokens` tokens per GPU (a row of sp × tokens split over sp GPUs)."""
    params, hidden, layers, intermediate, heads, kv_heads, vocab, tied = MODELS[model]
    kv_width = hidden // heads * kv_heads
    embedding = vocab * hidden * (1 if tied else 2)
    layer_params = (params - embedding) / layers
    terms = {
        "state": 16 * params / GPUS,
        "gathered": 2 * (2 * layer_params + embedding),
        "checkpoints": layers * tokens * hidden * 2,
        "layer": 2 * tokens * (2 * (6 * hidden + 2 * kv_width + 4 * intermediate) + 4 * 2 * hidden),
        "logps": (min(CHUNK, tokens) * vocab * 10) if chunked else tokens * vocab * 4 * 4,
        "ring": 3 * tokens * kv_width * 2 * 2 if sp > 1 else 0,
    }
    return {name: value / GIB for name, value in terms.items()}


def lora_params(model: str, rank: int) -> float:
    """Adapter parameters of rank `rank` on every linear layer of the decoder (q, k, v, o, gate, up, down)."""
    _, hidden, layers, intermediate, heads, kv_heads, _, _ = MODELS[model]
    kv_width = hidden // heads * kv_heads
    return layers * rank * (9 * hidden + 2 * kv_width + 3 * intermediate)


def lora_state(model: str, rank: int) -> float:
    """GiB per GPU of the sharded state with LoRA: bf16 frozen base, fp32 adapters with gradients and moments."""
    return (2 * MODELS[model][0] + 16 * lora_params(model, rank)) / GPUS / GIB


def main() -> None:
    print(f"GiB per GPU, {GPUS} GPUs, FSDP over all, checkpointing on; fits = total <= {USABLE_GIB:.0f} GiB")
    print(f"{'model':5} {'sp':>2} {'tok/GPU':>7} {'row':>6} | {'state':>6} {'gather':>6} {'ckpts':>6} {'layer':>6} "
          f"{'logps':>6} {'ring':>5} | {'total':>6} fits | {'offload opt':>11} fits | {'full logits':>11} fits")
    for model in MODELS:
        for tokens in (16384, 32768):
            for sp in (1, 2, 4):
                terms = budget(model, tokens, sp)
                total = sum(terms.values())
                full = total - terms["logps"] + budget(model, tokens, sp, chunked=False)["logps"]
                offloaded = total - terms["state"] / 2
                print(f"{model:5} {sp:2d} {tokens:7d} {tokens * sp:6d} | {terms['state']:6.1f} {terms['gathered']:6.1f} "
                      f"{terms['checkpoints']:6.1f} {terms['layer']:6.1f} {terms['logps']:6.1f} {terms['ring']:5.2f} | "
                      f"{total:6.1f} {'yes' if total <= USABLE_GIB else 'no ':3} | "
                      f"{offloaded:11.1f} {'yes' if offloaded <= USABLE_GIB else 'no ':3} | {full:11.1f} "
                      f"{'yes' if full <= USABLE_GIB else 'no'}")
    print(f"\nLoRA, 16k tokens per GPU, sp = 1: state GiB per GPU (full tuning's beside it) and the step's total")
    for model in MODELS:
        terms = budget(model, 16384, 1)
        rest = sum(terms.values()) - terms["state"]
        cells = []
        for rank in (8, 32, 128):
            state = lora_state(model, rank)
            cells.append(f"r={rank}: {lora_params(model, rank) / 1e6:6.1f}M adapters, state {state:5.1f} "
                         f"(full {terms['state']:5.1f}), total {state + rest:5.1f}")
        print(f"{model:5} " + " | ".join(cells))


if __name__ == "__main__":
    main()
