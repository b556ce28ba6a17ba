"""Multi-turn rollouts with tools that take time: the hf engine's one schedule (a trajectory's next
turn starts as soon as its tool answers) against turn-by-turn generation (every turn waits for the
longest response and the slowest tool), same engine, prompts, token counts and tool latencies.

Each of `--trajectories` conversations takes `--turns` turns. A turn's response length is drawn
from a long-tailed distribution (most short, a few up to `--max-new-tokens`), as RL responses are;
eos is ignored, so both schedules generate exactly the same tokens. Between turns a tool answers
after a latency drawn the same way (median `--tool-ms`), then `--tool-tokens` tokens are appended.
Runs on CPU (a tiny model by default) and on a GPU.

    python bench/multi_turn_rollout.py [--trajectories 32 --turns 3 --max-new-tokens 64 --tool-ms 50]
"""

import argparse
import random
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from transformers import AutoTokenizer

from rl2.engines import Engine, HFEngine, SamplingParams, Turn
from rl2.testing.tiny import save_tiny


def long_tailed(rng: random.Random, median: float, cap: float) -> float:
    """A log-normal draw with the given median (sigma 1), capped."""
    return min(cap, median * rng.lognormvariate(0.0, 1.0))


def run(engine: HFEngine, prompts: list[list[int]], limits: list[list[int]], latencies: list[list[float]],
        tool_tokens: int, max_new_tokens: int, turn_by_turn: bool) -> tuple[int, float]:
    """(tokens generated, seconds) for one multi-turn rollout of every prompt."""
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    turns = len(limits[0])
    conversations = [list(p) for p in prompts]
    taken = [0] * len(prompts)
    generated = 0
    tools = ThreadPoolExecutor(max_workers=len(prompts))

    def tool(index: int) -> Turn:
        time.sleep(latencies[index][taken[index] - 1])
        conversations[index] += list(range(10, 10 + tool_tokens))
        return Turn(list(conversations[index]), limits[index][taken[index]])

    def on_generation(index: int, generation) -> Future | None:
        nonlocal generated
        generated += len(generation.token_ids)
        conversations[index] += generation.token_ids
        taken[index] += 1
        return None if taken[index] == turns else tools.submit(tool, index)

    first = [Turn(list(p), limits[i][0]) for i, p in enumerate(prompts)]
    generate_turns = (lambda *args: Engine.generate_turns(engine, *args)) if turn_by_turn else engine.generate_turns
    start = time.perf_counter()
    generate_turns(first, params, on_generation, turns)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tools.shutdown()
    return generated, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--median-new-tokens", type=int, default=12)
    parser.add_argument("--tool-ms", type=float, default=50.0, help="median tool latency")
    parser.add_argument("--tool-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs per schedule; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)

    rng = random.Random(args.seed)
    limits = [[max(1, round(long_tailed(rng, args.median_new_tokens, args.max_new_tokens))) for _ in range(args.turns)]
              for _ in range(args.trajectories)]
    latencies = [[long_tailed(rng, args.tool_ms / 1000, 20 * args.tool_ms / 1000) for _ in range(args.turns - 1)]
                 for _ in range(args.trajectories)]
    prompts = [[rng.randrange(10, 1000) for _ in range(args.prompt_tokens)] for _ in range(args.trajectories)]

    with tempfile.TemporaryDirectory() as folder:
        save_tiny(folder, hidden_size=args.hidden_size, num_layers=args.layers, num_heads=4, num_kv_heads=2)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        engine = HFEngine(folder, tokenizer, device, dtype=dtype, max_batch_size=args.max_batch_size)
        run(engine, prompts[:4], [row for row in limits[:4]], latencies[:4], args.tool_tokens,
            args.max_new_tokens, turn_by_turn=False)  # warm-up
        results = {}
        for name, turn_by_turn in (("turn by turn", True), ("one schedule", False)):
            best = min((run(engine, prompts, limits, latencies, args.tool_tokens, args.max_new_tokens, turn_by_turn)
                        for _ in range(args.repeats)), key=lambda result: result[1])
            results[name] = best
    tool_s = sum(max(row) for row in zip(*latencies)) if args.turns > 1 else 0.0
    print(f"device {device}; {args.trajectories} trajectories x {args.turns} turns; response lengths median "
          f"{args.median_new_tokens}, max {args.max_new_tokens}; tool latency median {args.tool_ms:.0f} ms "
          f"(turn by turn waits {tool_s:.2f} s for the slowest tools alone)")
    print(f"{'schedule':<14} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
    for name, (tokens, seconds) in results.items():
        print(f"{name:<14} {tokens:>7} {seconds:>8.2f} {tokens / seconds:>9.0f}")
    (base_tokens, base_s), (tokens, seconds) = results["turn by turn"], results["one schedule"]
    assert tokens == base_tokens == sum(map(sum, limits)), "both schedules must generate the same tokens"
    print(f"one schedule / turn by turn: {base_s / seconds:.2f}x")


if __name__ == "__main__":
    main()
