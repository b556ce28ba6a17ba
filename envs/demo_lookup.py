"""Env file of the multi-turn demo: a `lookup` tool knows each drawer's secret codes.

The model calls the tool by writing `<tool_call>lookup</tool_call>`; the tool reads the key and
drawer from the question and answers with the code, which nobody can guess (a hash). The reward
is 1 when the final reply's last number is the code.
"""

import hashlib
import re

QUESTION = re.compile(r"code of key (\d+) in drawer (\d+)")


def secret_code(drawer: int, key: int) -> int:
    return hashlib.sha256(f"{drawer}/{key}".encode()).digest()[0] % 10


def interact(messages: list[dict]) -> list[dict]:
    if "<tool_call>lookup</tool_call>" not in messages[-1]["content"]:
        return []  # no tool call: the episode ends
    key, drawer = QUESTION.search(messages[0]["content"]).groups()
    return [{"role": "tool", "content": f"The code is {secret_code(int(drawer), int(key))}."}]


def reward_fn(messages: list[dict], answer: str) -> float:
    numbers = re.findall(r"-?\d+", messages[-1]["content"])
    return float(messages[-1]["role"] == "assistant" and bool(numbers) and numbers[-1] == str(answer))
