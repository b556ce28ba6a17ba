"""Async functions that raise or hang, as the answer / last message says."""

import asyncio


async def reward_fn(messages, answer):
    if answer == "raise":
        raise RuntimeError("async failure")
    if answer == "sleep":
        await asyncio.sleep(30)  # cancelled by the timeout
    return 1.0


async def interact(messages):
    if messages[-1]["content"] == "sleep":
        await asyncio.sleep(30)
    return [{"role": "tool", "content": "ok"}]
