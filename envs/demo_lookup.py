"""Env file of the multi-turn demo: a `lookup` tool knows each drawer's secret codes.

The model calls the tool by writing `<tool_call>lookup</tool_call>`; the tool reads the box's
name from the question and answers with its code, which nobody can guess (a hash). The reward
is 1 when the final reply's last number is the code.
"""

import hashlib
import re

QUESTION = re.compile(r"code of the (\w+) (\w+) box")


def secret_code(colour: str, thing: str) -> int:
    return hashlib.sha256(f"{colour}/{thing}".encode()).digest()[0] % 10


def interact(messages: list[dict]) -> list[dict]:
    if "<tool_call>lookup</tool_call>" not in messages[-1]["content"]:
        return []  # no tool call: the episode ends
    colour, thing = QUESTION.search(messages[0]["content"]).groups()
    return [{"role": "tool", "content": tool_reply(secret_code(colour, thing))}]


def tool_reply(code: int) -> str:
    # The code read out eight times, like a lock's display: a 2-layer toy model learns to copy
    # a digit that occurs several times within a few dozen SFT steps, a single one much later.
    return "code " + " ".join([str(code)] * 8)


def reward_fn(messages: list[dict], answer: str) -> float:
    numbers = re.findall(r"-?\d+", messages[-1]["content"])
    return float(messages[-1]["role"] == "assistant" and bool(numbers) and numbers[-1] == str(answer))
