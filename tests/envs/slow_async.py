"""Async functions that each take 0.3 s, to show calls run concurrently."""

import asyncio


async def reward_fn(messages, answer):
    await asyncio.sleep(0.3)
    return 1.0


async def interact(messages):
    await asyncio.sleep(0.3)
    return [{"role": "tool", "content": "done"}]
