"""Data for the CPU demos, made locally: SFT warm-up rows, RL prompts and test prompts.

- `largest`: "Which is the largest of 3, 8, 5, 1?" (four distinct digits). The warm-up teaches
  the answer's format and to answer with one of the four numbers, picked at random (right 1
  time in 4); RL has to learn to pick the largest.
- `lookup`: "What is the code of the red fox box?" where the code is a hash of the name that only
  the env's `lookup` tool knows. The warm-up shows both guessing and calling the tool (then
  copying its answer); RL has to learn that calling the tool pays.
- `tools`: the `lookup` task with native function calling: the warm-up's calls are structured
  `tool_calls` of the stateful environment's `lookup()` (`envs/demo_tools.py`), its rows carry the
  tool's schema in a `tools` column, and the chat template writes both.

    python recipes/make_demo_data.py --task largest --out /tmp/demo_largest
"""

import argparse
import functools
import json
import os
import random
import sys

from transformers.utils import get_json_schema

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "envs"))
from demo_lookup import secret_code, tool_reply  # noqa: E402  (the env file owns the secret)
from demo_tools import Boxes  # noqa: E402


def successor_rows(rng: random.Random, n: int, boxed_ratio: float = 0.15) -> tuple[list[dict], list[dict]]:
    sft, rl = [], []
    for _ in range(n):
        number = rng.randint(0, 8)
        prompt = [{"role": "user", "content": f"What number comes after {number}?"}]
        reply = f"\\boxed{{{number + 1}}}" if rng.random() < boxed_ratio else f"The answer is {number + 1}."
        sft.append({"messages": prompt + [{"role": "assistant", "content": reply}]})
        rl.append({"messages": prompt, "answer": str(number + 1)})
    return sft, rl


# Words without digits: the tool's answer is then the only number the model can copy.
COLOURS = "red blue green black white gold pink grey brown orange purple silver".split()
THINGS = "cat dog fox owl bee ant cow pig hen elk yak ram bat eel emu ape".split()


def lookup_rows(rng: random.Random, n: int) -> tuple[list[dict], list[dict]]:
    sft, rl = [], []
    for _ in range(n):
        colour, thing = rng.choice(COLOURS), rng.choice(THINGS)
        code = secret_code(colour, thing)
        prompt = [{"role": "user", "content": f"What is the code of the {colour} {thing} box?"}]
        if rng.random() < 0.5:
            reply = [
                {"role": "assistant", "content": "<tool_call>lookup</tool_call>"},
                {"role": "tool", "content": tool_reply(code)},
                {"role": "assistant", "content": f"The answer is {code}."},
            ]
        else:
            reply = [{"role": "assistant", "content": f"The answer is {rng.randint(0, 9)}."}]
        sft.append({"messages": prompt + reply})
        rl.append({"messages": prompt, "answer": str(code)})
    return sft, rl


def tools_rows(rng: random.Random, n: int) -> tuple[list[dict], list[dict]]:
    sft, rl = [], []
    schema = get_json_schema(Boxes.__new__(Boxes).lookup)
    for _ in range(n):
        colour, thing = rng.choice(COLOURS), rng.choice(THINGS)
        code = secret_code(colour, thing)
        prompt = [{"role": "user", "content": f"What is the code of the {colour} {thing} box?"}]
        if rng.random() < 0.5:
            call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": {}}}
            reply = [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "name": "lookup", "content": tool_reply(code)},
                {"role": "assistant", "content": f"The answer is {code}."},
            ]
        else:
            reply = [{"role": "assistant", "content": f"The answer is {rng.randint(0, 9)}."}]
        sft.append({"messages": prompt + reply, "tools": [schema]})
        rl.append({"messages": prompt, "answer": str(code)})
    return sft, rl


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=["successor", "lookup", "tools"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--test-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--boxed-ratio", type=float, default=0.15,
                        help="successor: the share of SFT replies in the rewarded \\boxed{n} format (the teacher of "
                             "recipes/distill_tiny.sh learns it from 1.0)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    successor = functools.partial(successor_rows, boxed_ratio=args.boxed_ratio)
    make = {"successor": successor, "lookup": lookup_rows, "tools": tools_rows}[args.task]
    sft, train = make(rng, args.rows)
    _, test = make(rng, args.test_rows)
    os.makedirs(args.out, exist_ok=True)
    write_jsonl(os.path.join(args.out, "sft.jsonl"), sft)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "test.jsonl"), test)
    print(f"wrote {len(sft)} SFT rows, {len(train)} RL prompts and {len(test)} test prompts to {args.out}")


if __name__ == "__main__":
    main()
