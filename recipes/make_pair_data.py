"""A small, learnable preference set for the reward-model and DPO demos, made locally.

"Tell me about the lamp." → chosen "The lamp is warm and bright.", rejected "The lamp is dull and
broken.": chosen replies use kind adjectives, rejected ones unkind adjectives, in the same sentence
shapes. The test set asks about objects that never appear in training, so a model has to learn the
pattern, not the rows.

    python recipes/make_pair_data.py OUT_DIR --rows 256 --test-rows 32   # OUT_DIR/train.jsonl, test.jsonl
"""

import argparse
import json
import os
import random

KIND = "bright calm clean fresh gentle kind lovely warm neat sweet".split()
UNKIND = "broken dirty dull grim harsh rotten ugly weak sour rough".split()
TEMPLATES = ["The {noun} is {a} and {b}.", "I find the {noun} {a}, even {b}.", "A {a}, {b} {noun}."]
PROMPTS = ["Tell me about the {noun}.", "What is the {noun} like?", "Describe the {noun}."]
TRAIN_NOUNS = (
    "lamp river garden house table chair window bridge forest road boat train city park lake "
    "book song cake coat door field hill room shop street"
).split()
TEST_NOUNS = "castle island market harbour meadow tower".split()


def make_rows(n: int, nouns: list[str], rng: random.Random) -> list[dict]:
    """n pairs about `nouns`: the chosen reply has two kind adjectives, the rejected one two unkind ones."""
    rows = []
    for _ in range(n):
        noun = rng.choice(nouns)
        template = rng.choice(TEMPLATES)
        chosen = template.format(noun=noun, a=rng.choice(KIND), b=rng.choice(KIND))
        rejected = template.format(noun=noun, a=rng.choice(UNKIND), b=rng.choice(UNKIND))
        prompt = [{"role": "user", "content": rng.choice(PROMPTS).format(noun=noun)}]
        rows.append({"messages": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--test-rows", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out_dir, exist_ok=True)
    write_jsonl(os.path.join(args.out_dir, "train.jsonl"), make_rows(args.rows, TRAIN_NOUNS, rng))
    write_jsonl(os.path.join(args.out_dir, "test.jsonl"), make_rows(args.test_rows, TEST_NOUNS, rng))
    print(f"{args.rows} training and {args.test_rows} test pairs written to {args.out_dir}")


if __name__ == "__main__":
    main()
