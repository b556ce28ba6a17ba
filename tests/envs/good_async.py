"""The same env as good_sync.py, written with async functions."""

import asyncio


async def reward_fn(messages, answer):
    await asyncio.sleep(0)
    return float(messages[-1]["content"] == str(answer))


async def interact(messages):
    await asyncio.sleep(0)
    last = messages[-1]["content"]
    if last == "bye":
        return []
    return [{"role": "tool", "content": f"echo: {last}"}]
