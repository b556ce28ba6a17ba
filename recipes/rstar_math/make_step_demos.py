"""Demonstrations of the step format for the tiny CPU variant's warm-up (a random-init model never
writes `<end_of_step>` by chance; a real policy is prompted or SFT'd into it instead).

    python recipes/rstar_math/make_step_demos.py --rows train.jsonl --out demos.jsonl [--copies 8]

Each "What is A + B?" row becomes a two-step solution: a program that prints A + B, its output,
and the boxed answer.
"""

import argparse
import json
import re


def demo(row: dict) -> dict:
    a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", row["messages"][-1]["content"]).groups())
    solution = (f"Add the numbers.\n```python\nprint({a} + {b})\n```<end_of_step>\n```output\n{a + b}\n```\n"
                f"The answer is \\boxed{{{a + b}}}.<end_of_answer>")
    return {"messages": row["messages"] + [{"role": "assistant", "content": solution}]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--copies", type=int, default=4)
    args = parser.parse_args()
    with open(args.rows, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(args.out, "w", encoding="utf-8") as f:
        for _ in range(args.copies):
            f.writelines(json.dumps(demo(row)) + "\n" for row in rows)
    print(f"{len(rows) * args.copies} demonstrations -> {args.out}")


if __name__ == "__main__":
    main()
