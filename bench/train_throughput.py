"""Training tokens/s on CPU: packed rows (no padding) against padded batches, same model, data and run.

Both sides run forward + backward (packed: rl2's variable-length attention; padded: sdpa) over the same sequences in the same number of micro-batches:
packed rows come from `plan_micro_batches` + `pack_micro_batch`; the padded baseline takes the
sequences in data order, pads each micro-batch to its longest sequence and masks the padding.
Only real (non-padding) tokens count towards tokens/s.

    python bench/train_throughput.py [--hidden 256 --layers 4 --sequences 64 --repeats 3]
"""

import argparse
import math
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from rl2.distributed.packing import pack_micro_batch, plan_micro_batches
from rl2.kernels.attention import packed_attention_implementation
from rl2.testing.tiny import save_tiny
from rl2.workers.policy import token_logps


def long_tailed_lengths(n: int, seed: int, max_length: int) -> list[int]:
    """Mostly short, a few long: the shape of RL responses and chat SFT data."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=generator)
    lengths = (5.0 + 0.8 * normal).exp().clamp(16, max_length)
    return [int(x) for x in lengths.tolist()]


def packed_step(model, sequences, max_tokens: int) -> int:
    plan = plan_micro_batches([len(s["input_ids"]) for s in sequences], 1, max_tokens)[0]
    for indices in plan:
        row = pack_micro_batch([sequences[i] for i in indices])
        logits = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
        logps = token_logps(logits, row["input_ids"], row["position_ids"])
        (-(logps * row["loss_mask"]).sum()).backward()
    return len(plan)


def padded_step(model, sequences, n_micro_batches: int, pad_id: int) -> None:
    size = math.ceil(len(sequences) / n_micro_batches)
    for start in range(0, len(sequences), size):
        chunk = sequences[start : start + size]
        width = max(len(s["input_ids"]) for s in chunk)
        input_ids = torch.full((len(chunk), width), pad_id)
        attention_mask = torch.zeros(len(chunk), width, dtype=torch.long)
        loss_mask = torch.zeros(len(chunk), width)
        for i, s in enumerate(chunk):
            n = len(s["input_ids"])
            input_ids[i, :n], attention_mask[i, :n], loss_mask[i, :n] = s["input_ids"], 1, s["loss_mask"]
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None])[..., 0]
        (-(logps * loss_mask[:, 1:]).sum()).backward()


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as folder:
        save_tiny(folder, hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2)
        packed_model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation=packed_attention_implementation(torch.device("cpu"))
        )
        padded_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    packed_model.train()
    padded_model.train()
    model = padded_model
    vocab = model.config.vocab_size
    lengths = long_tailed_lengths(args.sequences, 0, args.max_length)
    sequences = [
        {"input_ids": torch.randint(3, vocab, (n,)), "loss_mask": torch.ones(n, dtype=torch.long)} for n in lengths
    ]
    real_tokens = sum(lengths)

    n_micro_batches = packed_step(packed_model, sequences, args.max_tokens)
    packed_model.zero_grad()
    packed_s = timed(lambda: packed_step(packed_model, sequences, args.max_tokens), args.repeats)
    padded_s = timed(lambda: padded_step(model, sequences, n_micro_batches, model.config.pad_token_id), args.repeats)
    size = math.ceil(len(sequences) / n_micro_batches)
    padded_tokens = sum(
        max(lengths[i : i + size]) * len(lengths[i : i + size]) for i in range(0, len(lengths), size)
    )

    print(f"model: Qwen2 hidden {args.hidden}, {args.layers} layers; {args.sequences} sequences, "
          f"{real_tokens} real tokens (lengths {min(lengths)}..{max(lengths)}, mean {real_tokens / len(lengths):.0f})")
    print(f"micro-batches per step: {n_micro_batches} (packed, <= {args.max_tokens} tokens) and {n_micro_batches} (padded)")
    print(f"{'layout':<8} {'step s':>8} {'tokens/s':>10} {'computed tokens':>16}")
    print(f"{'packed':<8} {packed_s:8.3f} {real_tokens / packed_s:10.0f} {real_tokens:16d}")
    print(f"{'padded':<8} {padded_s:8.3f} {real_tokens / padded_s:10.0f} {padded_tokens:16d}")
    print(f"packed / padded throughput: {padded_s / packed_s:.2f}x (padding share of the padded batch: "
          f"{1 - real_tokens / padded_tokens:.0%})")


if __name__ == "__main__":
    main()
