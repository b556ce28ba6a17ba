"""The worker processes of an RL2 HEAD env file, seen from the trainer: each loads the file and runs its
share of a rollout's episodes on an event loop of its own main thread (`rl2.rollout.rl2_head_worker`).

A worker whose loop is blocked past the episodes' timeout (a sync call that hangs) is killed, one that dies
(a crash, its memory limit) is noticed: either way its share's trajectories get an error naming the file and
what happened, the pool starts a fresh worker, and the run goes on.
"""

import asyncio
import os
import pickle
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rl2.compat.rl2_head_api import Sample
from rl2.rollout.env_file import EnvError, describe_exception
from rl2.rollout.env_worker import encode_args
from rl2.tools.worker_pool import PICKLE, WorkerFailed, WorkerPool, WorkerTimeout, child_python_environment

START_TIMEOUT = 120.0  # seconds a worker may take to import the env file
GRACE = 10.0  # seconds past the episodes' timeout before a worker whose loop does not answer is killed


class RL2HeadWorkers:
    """`workers` processes running the env file at `path`, each with `tokenizer` (pickled to them) and at
    most `memory_mb` of memory (0: no limit). `EnvError` when the file does not load in them."""

    def __init__(self, path: str, args: dict[str, Any], tokenizer, workers: int, memory_mb: int):
        self.path, self.workers = path, workers
        self._folder = tempfile.TemporaryDirectory(prefix="rl2-head-")  # removed with this object, or at exit
        tokenizer_path = os.path.join(self._folder.name, "tokenizer.pkl")
        with open(tokenizer_path, "wb") as f:
            pickle.dump(tokenizer, f)
        command = [sys.executable, "-m", "rl2.rollout.rl2_head_worker", os.path.abspath(path), encode_args(args),
                   tokenizer_path, str(memory_mb)]
        try:
            # retries=0: a share whose worker died (the file crashed it) is not run again.
            self._pool = WorkerPool("rl2_head_worker", [command] * workers, retries=0, env=child_python_environment(),
                                    start_timeout=START_TIMEOUT, codec=PICKLE)
        except WorkerFailed as error:
            self._folder.cleanup()
            raise EnvError(f"env file {path} could not be loaded in its worker processes: {error}") from None
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rl2-head-dispatch")

    def shares(self, count: int) -> list[list[int]]:
        """Episodes 0..count-1 in at most `workers` shares of consecutive indices, one per worker."""
        size = -(-count // self.workers) if count else 1
        return [list(range(start, min(start + size, count))) for start in range(0, count, size)]

    async def run(self, config: Any, urls: list[str], samples: list[Sample],
                  timeout: float) -> list[tuple[Sample, str | None]]:
        """One worker's run of the episodes of `samples` at `urls`: each sample as its episode left it (the one
        given where it did not come back) and why it failed (None: it did not)."""
        request = {"config": config, "urls": urls, "samples": samples, "timeout": timeout}
        try:
            response = await asyncio.get_running_loop().run_in_executor(
                self._threads, self._pool.call, request, timeout + GRACE)
        except WorkerTimeout as error:
            return [(sample, f"env file {self.path}: its worker's event loop did not answer within {timeout:g} s "
                             f"(blocked by a call that does not return?): {error}") for sample in samples]
        except WorkerFailed as error:
            return [(sample, f"env file {self.path}: its worker failed running the episode: {error}")
                    for sample in samples]
        if "outcomes" not in response:  # the worker's own handler raised
            return [(sample, f"env file {self.path}: its worker failed: {response.get('error')}") for sample in samples]
        results = []
        for sample, (blob, error) in zip(samples, response["outcomes"]):
            try:
                results.append((sample if blob is None else pickle.loads(blob), error))
            except Exception as exc:  # noqa: BLE001 - a class of the file's own in the sample
                results.append((sample, error or f"env file {self.path}: its sample cannot be read back from the "
                                                  f"worker ({describe_exception(exc)})"))
        return results

    def close(self) -> None:
        self._pool.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._folder.cleanup()
