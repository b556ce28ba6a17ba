"""Env file of the single-turn demo: the reward is 1 when the reply's last number is the answer."""

import re


def reward_fn(messages: list[dict], answer: str) -> float:
    numbers = re.findall(r"-?\d+", messages[-1]["content"])
    return float(bool(numbers) and numbers[-1] == str(answer))
