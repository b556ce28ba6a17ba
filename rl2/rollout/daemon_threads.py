"""A thread pool of daemon threads, for the sync functions of an env file in thread mode
(`rollout.env_workers=0`).

A call that hangs (in C, where nothing but a kill stops it) keeps its thread, as in any thread pool; but
a daemon thread does not hold the process at exit, as a `ThreadPoolExecutor`'s threads do (they are
joined at interpreter exit: one hung call kept the trainer from ever exiting).
"""

import concurrent.futures
import queue
import threading
from typing import Any, Callable


class DaemonThreadExecutor(concurrent.futures.Executor):
    """At most `max_workers` daemon threads, started as calls need them, each running calls one at a time."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "rl2-daemon"):
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self.max_workers, self.thread_name_prefix = max_workers, thread_name_prefix
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (future, fn, args, kwargs), or None: stop
        self._idle = threading.Semaphore(0)  # one release per thread waiting for a call
        self._lock = threading.Lock()  # guards _closed and _threads
        self._closed = False
        self._threads = 0

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._calls.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and self._threads < self.max_workers:
                self._threads += 1
                threading.Thread(target=self._work, name=f"{self.thread_name_prefix}-{self._threads}",
                                 daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new calls and stop the threads once idle (`cancel_futures`: calls not started are
        cancelled). A running call is never waited for: a hung one would never return."""
        with self._lock:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        item = self._calls.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            for _ in range(self._threads):
                self._calls.put(None)

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller, as an executor does
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del item, future
            self._idle.release()
