"""Data for the CPU demos, made locally: SFT warm-up rows, RL prompts and test prompts.

- `add`: "What is a + b?" with a, b in 0..4. The warm-up teaches the answer's format with a
  random number (so the warmed-up policy is right about 1 time in 9); RL has to learn the sums.
- `lookup`: "What is the code of key K in drawer D?" where the code is a hash of (D, K) that only
  the env's `lookup` tool knows. The warm-up shows both guessing and calling the tool (then
  copying its answer); RL has to learn that calling the tool pays.

    python recipes/make_demo_data.py --task add --out /tmp/demo_add
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "envs"))
from demo_lookup import secret_code  # noqa: E402  (the env file owns the secret)


def add_rows(rng: random.Random, n: int) -> tuple[list[dict], list[dict]]:
    sft, rl = [], []
    for _ in range(n):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        prompt = [{"role": "user", "content": f"What is {a} + {b}?"}]
        sft.append({"messages": prompt + [{"role": "assistant", "content": f"The answer is {rng.randint(0, 8)}."}]})
        rl.append({"messages": prompt, "answer": str(a + b)})
    return sft, rl


def lookup_rows(rng: random.Random, n: int) -> tuple[list[dict], list[dict]]:
    sft, rl = [], []
    for _ in range(n):
        key, drawer = rng.randint(0, 9), rng.randint(100, 999)
        code = secret_code(drawer, key)
        prompt = [{"role": "user", "content": f"What is the code of key {key} in drawer {drawer}?"}]
        if rng.random() < 0.5:
            reply = [
                {"role": "assistant", "content": "<tool_call>lookup</tool_call>"},
                {"role": "tool", "content": f"The code is {code}."},
                {"role": "assistant", "content": f"The answer is {code}."},
            ]
        else:
            reply = [{"role": "assistant", "content": f"The answer is {rng.randint(0, 9)}."}]
        sft.append({"messages": prompt + reply})
        rl.append({"messages": prompt, "answer": str(code)})
    return sft, rl


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["add", "lookup"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--test-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    make = add_rows if args.task == "add" else lookup_rows
    sft, train = make(rng, args.rows)
    _, test = make(rng, args.test_rows)
    os.makedirs(args.out, exist_ok=True)
    write_jsonl(os.path.join(args.out, "sft.jsonl"), sft)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "test.jsonl"), test)
    print(f"wrote {len(sft)} SFT rows, {len(train)} RL prompts and {len(test)} test prompts to {args.out}")


if __name__ == "__main__":
    main()
