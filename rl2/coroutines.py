"""Running a coroutine to completion from synchronous code."""

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import Any


def run_coroutine(make: Callable[[], Awaitable]) -> Any:
    """Run the coroutine `make()` to completion from synchronous code, even inside a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    # A loop already runs in this thread (a notebook): asyncio.run would refuse, so use a new thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(lambda: asyncio.run(make())).result()
