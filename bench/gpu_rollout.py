"""Rollout throughput at GPU scale: the `hf` engine against one batched `model.generate` call, same
weights, prompts, sampling and token counts, in one run.

Cases (prompts of 64..512 tokens, `--new-tokens` each, eos ignored, temperature 1):
- `distinct B`: B different prompts;
- `shared B`: B/8 prompts, 8 responses each (the engine prefills each prompt once);
- `multi-turn`: B/8 conversations of 3 turns, each turn followed by 32 tool tokens; the engine
  runs them in one schedule (`generate_turns`) and continues its kept caches, `model.generate`
  re-reads the whole conversation every turn.
The engine runs each case twice: the first call includes capturing its CUDA graphs (as after
every `sleep` in training), the second is steady state. The bandwidth bound is the decode step
that only reads the weights and each row's keys and values once, at the GPU's memory bandwidth
(3.35 TB/s, H100 SXM); the engine's share of it is printed.

    python bench/gpu_rollout.py [--shape 0.5b] [--batches 128 512] [--new-tokens 256]
    python bench/gpu_rollout.py --shape tiny --batches 16 --new-tokens 16 --min-prompt 8 --max-prompt 48   # CPU
"""

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import Future

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_train import SHAPES, save_shape  # noqa: E402

from rl2.engines import HFEngine, SamplingParams, Turn  # noqa: E402
from rl2.testing.tiny import build_tiny_tokenizer  # noqa: E402

H100_BANDWIDTH = 3.35e12
RESPONSES_PER_PROMPT = 8
TURNS, TOOL_TOKENS = 3, 32


def prompts_for(count: int, vocab: int, min_length: int, max_length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_length, max_length + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def generate_batched(model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> list[list[int]]:
    """One `model.generate` call over all prompts, left-padded, `new_tokens` sampled per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    out = model.generate(
        ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=1.0, top_k=None, top_p=1.0,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
    )
    return out[:, width:].tolist()


def run_engine(engine: HFEngine, conversations: list[list[int]], new_tokens: int, turns: int) -> int:
    """Tokens generated; the turns run in the engine's one schedule (`generate_turns`), the tool
    tokens appended as soon as a turn ends."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    conversations = [list(c) for c in conversations]
    taken = [0] * len(conversations)

    def on_generation(index: int, generation) -> Future | None:
        conversations[index] += generation.token_ids
        taken[index] += 1
        if taken[index] == turns:
            return None
        conversations[index] += list(range(10, 10 + TOOL_TOKENS))
        future = Future()
        future.set_result(Turn(list(conversations[index]), new_tokens))
        return future

    start = sum(map(len, conversations))
    engine.generate_turns([Turn(c, new_tokens) for c in conversations], params, on_generation, turns)
    return sum(map(len, conversations)) - start - (turns - 1) * TOOL_TOKENS * len(conversations)


def run_generate(model, conversations: list[list[int]], new_tokens: int, turns: int, device) -> int:
    generated = 0
    for turn in range(turns):
        outputs = generate_batched(model, conversations, new_tokens, device)
        generated += sum(len(tokens) for tokens in outputs)
        if turn < turns - 1:
            conversations = [c + g + list(range(10, 10 + TOOL_TOKENS)) for c, g in zip(conversations, outputs)]
    return generated


def timed(fn, device) -> tuple[int, float]:
    synchronize(device)
    start = time.perf_counter()
    tokens = fn()
    synchronize(device)
    return tokens, time.perf_counter() - start


def bandwidth_bound(engine: HFEngine, rows: int, mean_context: float) -> float:
    """Tokens/s if a decode step of `rows` rows only read the weights and their KV once at H100 bandwidth."""
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    step_bytes = weight_bytes + rows * mean_context * engine.kv.bytes_per_position()
    return rows / (step_bytes / H100_BANDWIDTH)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.5b", choices=list(SHAPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--cases", nargs="+", default=["distinct", "shared", "multi-turn"])
    parser.add_argument("--attention", default="auto", help="rollout.attn_implementation (the engine's prefill)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="rollout.cuda_graphs=false")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}; shape {args.shape}, {dtype}, "
          f"prompts of {args.min_prompt}..{args.max_prompt} tokens, {args.new_tokens} new tokens, temperature 1")
    print(f"{'case':<16} {'requests':>8} {'method':<22} {'seconds':>8} {'tokens':>8} {'tokens/s':>10} {'vs generate':>11}"
          f" {'of bound':>8}")

    with tempfile.TemporaryDirectory() as folder:
        config = save_shape(args.shape, folder)
        build_tiny_tokenizer().save_pretrained(folder)  # for eos and stop strings; eos is ignored here
        tokenizer = AutoTokenizer.from_pretrained(folder)
        for batch in args.batches:
            engine = HFEngine(folder, tokenizer, device, dtype=dtype, seed=0, max_batch_size=batch,
                              attn_implementation=args.attention, cuda_graphs=not args.no_cuda_graphs)
            print(f"batch {batch}: prefill attention {engine.prefill_attention}, "
                  f"CUDA graphs {'on' if engine.decode.use_graphs else 'off'}", flush=True)
            # The baseline: transformers' own model and generate, sdpa attention, the same weights.
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=engine.model.dtype, attn_implementation="sdpa")
            model = model.to(device).eval()
            for case in args.cases:
                turns = TURNS if case == "multi-turn" else 1
                distinct = batch if case == "distinct" else batch // RESPONSES_PER_PROMPT
                prompts = prompts_for(distinct, config.vocab_size, args.min_prompt, args.max_prompt, seed=batch)
                if case != "distinct":
                    prompts = [p for p in prompts for _ in range(RESPONSES_PER_PROMPT)]
                engine.sleep()  # as in training: the first call captures its graphs again
                engine.wake()
                first_tokens, first_s = timed(lambda: run_engine(engine, prompts, args.new_tokens, turns), device)
                engine.reseed(0)
                tokens, engine_s = timed(lambda: run_engine(engine, prompts, args.new_tokens, turns), device)
                generate_batched(model, prompts[:2], 4, device)  # warm-up
                base_tokens, base_s = timed(lambda: run_generate(model, prompts, args.new_tokens, turns, device), device)
                assert tokens == base_tokens == first_tokens, (tokens, base_tokens, first_tokens)
                mean_context = sum(len(p) for p in prompts) / len(prompts) + args.new_tokens / 2
                bound = bandwidth_bound(engine, len(prompts), mean_context)
                base_tps = base_tokens / base_s
                for method, seconds in (("hf engine (+capture)", first_s), ("hf engine", engine_s),
                                        ("model.generate", base_s)):
                    tps = tokens / seconds
                    share = f"{tps / bound:7.1%}" if device.type == "cuda" else "-"
                    print(f"{case:<16} {len(prompts):>8} {method:<22} {seconds:8.2f} {tokens:8d} {tps:10.0f} "
                          f"{tps / base_tps:10.2f}x {share:>8}", flush=True)
            engine = model = None  # free both before the next batch size
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
