"""Sync functions that each take 0.3 s, to show calls run concurrently."""

import time


def reward_fn(messages, answer):
    time.sleep(0.3)
    return 1.0


def interact(messages):
    time.sleep(0.3)
    return [{"role": "tool", "content": "done"}]
