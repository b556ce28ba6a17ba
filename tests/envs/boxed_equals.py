"""Reward 1.0 when the last \\boxed{...} of the reply equals the answer as text, else 0.0."""

import re


def reward_fn(messages, answer):
    boxes = re.findall(r"\\boxed\{([^{}]*)\}", messages[-1]["content"])
    return float(bool(boxes) and boxes[-1].strip() == str(answer))
