"""Sync functions that misbehave in the way the answer (reward_fn) or last message (interact) names."""

import time


def reward_fn(messages, answer):
    if answer == "raise":
        raise ValueError("no reward for you")
    if answer == "sleep":
        time.sleep(1.0)  # past the test's 0.2 s timeout
    if answer == "str":
        return "1.0"
    if answer == "none":
        return None
    if answer == "nan":
        return float("nan")
    if answer == "bool":
        return True
    return 1


def interact(messages):
    kind = messages[-1]["content"]
    if kind == "raise":
        raise KeyError("tool")
    if kind == "sleep":
        time.sleep(1.0)
    if kind == "dict":
        return {"role": "tool", "content": "not in a list"}
    if kind == "no content":
        return [{"role": "tool"}]
    if kind == "int content":
        return [{"role": "tool", "content": 42}]
    if kind == "str item":
        return ["tool output"]
    if kind == "tuple":
        return ({"role": "tool", "content": "ok"},)
    return [{"role": "tool", "content": "ok"}]
