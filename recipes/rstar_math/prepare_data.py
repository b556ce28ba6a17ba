"""rStar-Math data: math problems as rl2 RL rows whose system prompt asks for code-augmented steps.

    python recipes/rstar_math/prepare_data.py --input math_train.jsonl --output train.jsonl
    python recipes/rstar_math/prepare_data.py --arithmetic 64 --seed 0 --output train.jsonl

An input row has the problem in `problem` or `question` and the reference answer in `answer`
(or the last `\\boxed{}` of `solution`), as in MATH, GSM8K-style files or NuminaMath. `--arithmetic
N` writes N small addition problems instead, for the tiny CPU variant.
"""

import argparse
import json
import random
import re
import sys

SYSTEM_PROMPT = (
    "Solve the problem step by step. A step is a short piece of reasoning, optionally followed by Python "
    "code in a ```python block whose output you will be shown, and ends with <end_of_step>. The last step "
    "gives the final answer in \\boxed{} and ends with <end_of_answer>."
)


def rl_row(problem: str, answer: str) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}],
            "answer": answer}


def boxed(solution: str) -> str | None:
    found = re.findall(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}", solution)
    return found[-1] if found else None


def from_file(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            raw = json.loads(line)
            problem = raw.get("problem") or raw.get("question")
            answer = raw.get("answer") or boxed(raw.get("solution", ""))
            if not problem or answer is None:
                sys.exit(f"{path}, row {number}: needs `problem` (or `question`) and `answer` (or a boxed `solution`)")
            rows.append(rl_row(problem, str(answer).split("####")[-1].strip()))
    return rows


def arithmetic(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(rl_row(f"What is {a} + {b}?", str(a + b)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="JSON lines file of problems")
    parser.add_argument("--arithmetic", type=int, help="write this many addition problems instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    if (args.input is None) == (args.arithmetic is None):
        parser.error("give exactly one of --input and --arithmetic")
    rows = from_file(args.input) if args.input else arithmetic(args.arithmetic, args.seed)
    with open(args.output, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    print(f"{len(rows)} problems -> {args.output}")


if __name__ == "__main__":
    main()
