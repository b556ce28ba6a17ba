"""The vision demo's task (`make demo-vision`): 56x56 images drawn with PIL, 1-4 shapes (squares or discs) of
one colour on white, each in its own quadrant; the question is "How many shapes?" (answer: a digit) or "What
colour?" (answer: its letter, r g b or y). Every answer is one token of the tiny tokenizer.

`python -m rl2.testing.vision_task OUT [--rows 4000] [--seed 0] [--label-accuracy 1.0]` writes OUT/images/*.png,
OUT/sft.jsonl (the warm-up's conversations: their answers right `label-accuracy` of the time, else one of the
other options), OUT/train.jsonl and OUT/test.jsonl (RL prompts: an `<image>` placeholder in the question, the
image's path in `images`, the right answer in `answer`, the question's kind in `data_source`).
"""

import argparse
import json
import os
import random

from PIL import Image, ImageDraw

SIZE = 56
COLOURS = {"r": (220, 30, 30), "g": (30, 180, 40), "b": (30, 60, 220), "y": (230, 200, 20)}
QUESTIONS = {"count": "<image>How many shapes?", "colour": "<image>What colour? (r, g, b or y)"}
QUADRANTS = [(0, 0), (28, 0), (0, 28), (28, 28)]


def draw_shapes(rng: random.Random, count: int, colour: str) -> Image.Image:
    """A white 56x56 image with `count` shapes of `colour` (a key of COLOURS), one in each of `count` quadrants."""
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for x0, y0 in rng.sample(QUADRANTS, count):
        side = rng.randint(12, 20)
        x, y = x0 + rng.randint(2, 26 - side), y0 + rng.randint(2, 26 - side)
        box = (x, y, x + side, y + side)
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=COLOURS[colour])
    return image


def task_row(rng: random.Random, image_path: str) -> dict:
    """One RL row: an image saved at `image_path`, a question about it and its answer."""
    count, colour = rng.randint(1, 4), rng.choice(list(COLOURS))
    draw_shapes(rng, count, colour).save(image_path)
    kind = rng.choice(list(QUESTIONS))
    answer = str(count) if kind == "count" else colour
    return {"messages": [{"role": "user", "content": QUESTIONS[kind]}], "images": [image_path], "answer": answer,
            "data_source": kind}


def options(answer: str) -> list[str]:
    """The answers of the question `answer` answers (the digits, or the colour letters)."""
    return ["1", "2", "3", "4"] if answer.isdigit() else list(COLOURS)


def sft_row(rng: random.Random, row: dict, label_accuracy: float) -> dict:
    """The warm-up's conversation of an RL row: its answer `label_accuracy` of the time, else another option."""
    answer = row["answer"]
    if rng.random() >= label_accuracy:
        answer = rng.choice([option for option in options(answer) if option != answer])
    return {"messages": row["messages"] + [{"role": "assistant", "content": answer}], "images": row["images"]}


def write_task(out: str, rows: int, seed: int = 0, label_accuracy: float = 1.0, test_rows: int = 64) -> None:
    """OUT/sft.jsonl, train.jsonl and test.jsonl (`rows` warm-up and RL rows, `test_rows` test rows), images in
    OUT/images (absolute paths in the rows)."""
    rng = random.Random(seed)
    folder = os.path.abspath(os.path.join(out, "images"))
    os.makedirs(folder, exist_ok=True)
    files = {"sft": [], "train": [], "test": []}
    for i in range(rows + test_rows):
        row = task_row(rng, os.path.join(folder, f"{i}.png"))
        if i >= rows:
            files["test"].append(row)
            continue
        files["train"].append(row)
        files["sft"].append(sft_row(rng, row, label_accuracy))
    for name, content in files.items():
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--test-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label-accuracy", type=float, default=1.0)
    args = parser.parse_args()
    write_task(args.out, args.rows, args.seed, args.label_accuracy, args.test_rows)


if __name__ == "__main__":
    main()


def greedy_accuracy(model_dir: str, rows_path: str, limit: int | None = None) -> dict[str, float]:
    """The share of `rows_path`'s RL rows whose answer is the first token `model_dir` (a checkpoint of the tiny
    VLM) picks greedily, per question kind and in all, and `sampled`: the mean probability of the answer's token
    (the reward expected at temperature 1): the warm-up's and the policy's score without an engine."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from rl2.vision.inputs import build_vision_sample

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    with open(rows_path) as f:
        rows = [json.loads(line) for line in f][:limit]
    right: dict[str, list[bool]] = {}
    probability = 0.0
    with torch.no_grad():
        for i, row in enumerate(rows):
            sample = build_vision_sample(row, i, tokenizer, processor, add_generation_prompt=True)
            logits = model(input_ids=sample["input_ids"][None], pixel_values=sample["pixel_values"],
                           image_grid_thw=sample["image_grid_thw"]).logits[0, -1]
            answer = tokenizer.decode([int(logits.argmax())])
            answer_id = tokenizer(row["answer"], add_special_tokens=False)["input_ids"][0]
            probability += float(logits.softmax(-1)[answer_id])
            right.setdefault(row["data_source"], []).append(answer == row["answer"])
    scores = {kind: sum(hits) / len(hits) for kind, hits in right.items()}
    scores["all"] = sum(sum(hits) for hits in right.values()) / len(rows)
    scores["sampled"] = probability / len(rows)
    return scores
