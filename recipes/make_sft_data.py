"""Write a small, memorisable SFT dataset: reverse a word, add two numbers, capitalise a word."""

import argparse
import json
import random

WORDS = "apple river stone cloud green tiger music paper light ocean seven quiet table north bread water".split()


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        kind = rng.randrange(3)
        if kind == 0:
            word = rng.choice(WORDS)
            prompt, answer = f"Reverse the word {word}.", word[::-1]
        elif kind == 1:
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            prompt, answer = f"What is {a} + {b}?", str(a + b)
        else:
            word = rng.choice(WORDS)
            prompt, answer = f"Capitalise {word}.", word.upper()
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.out, "w") as f:
        for row in make_rows(args.rows, args.seed):
            f.write(json.dumps(row) + "\n")
    print(f"{args.rows} rows written to {args.out}")
