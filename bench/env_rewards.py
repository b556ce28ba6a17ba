"""reward_fn calls per second for a math-verify reward: the env file a user writes first (math-verify's
`parse` / `verify` called directly, with their own signal-based timeouts) in env worker processes
(rl2's default), against the only way it ran before them: threads in the trainer process with
math-verify's timeouts switched off (`parsing_timeout=None`, `timeout_seconds=None`), in the same run.
Both must give the same rewards. Calls go in batches, as a trainer's step makes them.

    python bench/env_rewards.py [--calls 10000 --batch 512 --workers N]
"""

import argparse
import logging
import os
import tempfile
import time

from rl2.rollout.env import Env, default_env_workers

# What a user writes: runs only where signals work (a main thread).
DIRECT = """
from math_verify import parse, verify


def reward_fn(messages, answer):
    return float(verify(parse(answer), parse(messages[-1]["content"])))
"""

# The same with math-verify's timeouts off, which is what threads allow: a pathological answer
# would hang its thread.
NO_TIMEOUTS = """
from math_verify import parse, verify


def reward_fn(messages, answer):
    gold = parse(answer, parsing_timeout=None)
    return float(verify(gold, parse(messages[-1]["content"], parsing_timeout=None), timeout_seconds=None))
"""

# (reply, gold): right and wrong answers in the forms math answers take.
PAIRS = [
    ("The area is \\boxed{\\frac{3}{2}}.", "1.5"),
    ("So x = \\boxed{2\\sqrt{2}}", "$\\sqrt{8}$"),
    ("Hence the answer is \\boxed{12}.", "13"),
    ("We get $\\boxed{\\{1, 2, 3\\}}$", "$\\{3, 2, 1\\}$"),
    ("Therefore \\boxed{x^2 + 2x + 1}", "$(x+1)^2$"),
    ("The probability is \\boxed{0.25}", "$\\frac{1}{3}$"),
    ("Final: \\boxed{\\pi/2}", "$\\frac{\\pi}{2}$"),
    ("It equals \\boxed{-7}", "-7"),
]


def measure(path: str, workers: int, calls: int, batch: int) -> tuple[float, list[float | None]]:
    """Calls per second over `calls` reward_fn calls in batches of `batch`, and the rewards."""
    conversations = [[{"role": "assistant", "content": PAIRS[i % len(PAIRS)][0]}] for i in range(calls)]
    answers = [PAIRS[i % len(PAIRS)][1] for i in range(calls)]
    with Env(path, workers=workers, concurrency=64) as env:
        env.rewards(conversations[:batch], answers[:batch])  # warm-up: workers started, imports done
        rewards: list[float | None] = []
        start = time.perf_counter()
        for begin in range(0, calls, batch):
            rewards += [r.value for r in env.rewards(conversations[begin:begin + batch], answers[begin:begin + batch])]
        return calls / (time.perf_counter() - start), rewards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--workers", type=int, default=default_env_workers(), help="env worker processes")
    args = parser.parse_args()
    logging.getLogger("rl2.rollout.env").setLevel(logging.ERROR)  # the refused calls' warnings
    with tempfile.TemporaryDirectory() as folder:
        direct, no_timeouts = os.path.join(folder, "direct.py"), os.path.join(folder, "no_timeouts.py")
        open(direct, "w").write(DIRECT)
        open(no_timeouts, "w").write(NO_TIMEOUTS)
        threads_rate, threads_rewards = measure(no_timeouts, 0, args.calls, args.batch)
        threads_direct_rate, threads_direct_rewards = measure(direct, 0, min(args.calls, args.batch), args.batch)
        processes_rate, processes_rewards = measure(direct, args.workers, args.calls, args.batch)
    assert processes_rewards == threads_rewards, "the two modes disagree"
    assert None not in processes_rewards
    failed = sum(reward is None for reward in threads_direct_rewards)
    print(f"{args.calls} reward_fn calls (math-verify), batches of {args.batch}, {os.cpu_count()} cores")
    print(f"  threads, math-verify's timeouts off (parsing_timeout=None): {threads_rate:8.0f} calls/s")
    print(f"  threads, math-verify called directly:                       {failed} of {len(threads_direct_rewards)} calls fail")
    print(f"  env worker processes ({args.workers}), called directly:           {processes_rate:8.0f} calls/s "
          f"({processes_rate / threads_rate:.2f}x threads)")
    print(f"  mean reward {sum(processes_rewards) / len(processes_rewards):.3f} in both")


if __name__ == "__main__":
    main()
