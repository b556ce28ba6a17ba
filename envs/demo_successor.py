"""Env file of the single-turn demo: the reward is 1 when the reply is exactly \\boxed{n} with n the
right number, and 0 otherwise (other formats, wrong numbers, text after the box)."""

import re


def reward_fn(messages: list[dict], answer: str) -> float:
    match = re.fullmatch(r"\s*\\boxed\{\s*(-?\d+)\s*\}\s*", messages[-1]["content"])
    return float(match is not None and match.group(1) == str(answer))
