"""A worker process for an RL2 HEAD env file: it loads the file once (RL2's modules installed) and runs the
file's `generate` coroutines on one event loop in its main thread, kept for the process's whole life, as
RL2 runs them on its trainer's main-thread loop (`python -m rl2.rollout.rl2_head_worker PATH ARGS TOKENIZER
MEMORY_MB`, started by `rl2.rollout.rl2_head_workers.RL2HeadWorkers`).

So what works under RL2 works here: math-verify's `parse` / `verify` (signal.alarm timeouts need the main
thread), asyncio objects a file makes at module level (gem.py's `Semaphore` and `Lock` bind to the first
loop that uses them: the same loop every step), module globals kept from one step to the next. A crash or a
hang in the file ends this process, not the run: the pool replaces it.

Request (pickled): `{"config", "urls", "samples", "timeout"}`: each sample's episode, run concurrently with
the others, at its trajectory's URL. Response: `{"outcomes": [(the sample pickled, or None; the error or
None), ...], "pid"}`.
"""

import asyncio
import base64
import faulthandler
import inspect
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

from rl2.compat.rl2_head_api import TRAJECTORY_URL, Sample, rl2_modules
from rl2.rollout.env_file import EnvArgs, EnvError, describe_exception, load_env_file, where
from rl2.rollout.env_worker import limit_memory
from rl2.tools.worker_pool import PICKLE, serve


def load_generate(path: str, args: EnvArgs) -> tuple[Any, Callable]:
    """The env file as a module (RL2's modules importable while it loads) and its async `generate`;
    `EnvError` naming what RL2 expects where it has none."""
    module = load_env_file(path, args, modules=rl2_modules())
    generate = getattr(module, "generate", None)
    if not callable(generate):
        raise EnvError(f"env file {path} is written to RL2's interface but defines no generate(config, tokenizer, "
                       f"router_url, sample) (RL2's: generate = partial(base_generate, env_step_fn=env_step))")
    if not inspect.iscoroutinefunction(getattr(generate, "func", generate)):
        raise EnvError(f"env file {path}: generate must be async, as RL2 runs it")
    return module, generate


async def run_episodes(generate: Callable, path: str, config: Any, tokenizer, urls: list[str],
                       samples: list[Sample], timeout: float) -> list[str | None]:
    """`generate(config, tokenizer, url, sample)` of each sample, concurrently, each in a task whose
    `TRAJECTORY_URL` is its URL, at most `timeout` seconds each; per sample, why it failed (None: it did
    not)."""

    async def one(url: str, sample: Sample) -> str | None:
        TRAJECTORY_URL.set(url)  # this task's (and the tasks it starts): the requests it makes are its own
        try:
            await asyncio.wait_for(generate(config, tokenizer, url, sample), timeout)
        except asyncio.TimeoutError:
            return f"env file {path}: generate did not finish within {timeout:g} s"
        except Exception as error:  # noqa: BLE001 - the user's file: recorded on its trajectory
            return f"env file {path}: generate raised{where(error, path)} {describe_exception(error)}"
        return None

    return list(await asyncio.gather(*(one(url, sample) for url, sample in zip(urls, samples))))


async def _answer(generate: Callable, path: str, tokenizer, request: dict) -> dict:
    samples = request["samples"]
    errors = await run_episodes(generate, path, request["config"], tokenizer, request["urls"], samples,
                                request["timeout"])
    outcomes: list[tuple[bytes | None, str | None]] = []
    for sample, error in zip(samples, errors):
        try:
            outcomes.append((pickle.dumps(sample), error))
        except Exception as exc:  # noqa: BLE001 - something of the file's own in the sample
            outcomes.append((None, error or f"env file {path}: the sample cannot be sent back from its worker "
                                            f"({describe_exception(exc)})"))
    return {"outcomes": outcomes, "pid": os.getpid()}


def main() -> None:
    path, args = sys.argv[1], pickle.loads(base64.b64decode(sys.argv[2]))
    tokenizer_path, memory_mb = sys.argv[3], int(sys.argv[4])
    faulthandler.enable()  # a segfault in user code prints where it happened (the pool quotes it)
    limit_memory(memory_mb)
    loop = asyncio.new_event_loop()  # before the file loads: what it makes at module level is this loop's
    asyncio.set_event_loop(loop)
    try:
        _, generate = load_generate(path, EnvArgs(args, path))
    except EnvError as error:
        sys.exit(f"rl2 env worker: {error}")
    with open(tokenizer_path, "rb") as f:
        tokenizer = pickle.load(f)
    serve(lambda request: loop.run_until_complete(_answer(generate, path, tokenizer, request)), PICKLE)


if __name__ == "__main__":
    main()
