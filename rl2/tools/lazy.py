"""A value made on first use and shared by every thread after that."""

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Lazy(Generic[T]):
    """`Lazy(factory).get()` calls `factory` once, at the first `get`, under a lock: env files use it
    for their worker pools (a sandbox, a grader), which must not be started at import or twice when
    many threads call `reward_fn` / `interact` at once. `rl2.rollout.env.Env.close()` closes every `Lazy`
    of its env file, so the pools' processes end with the run."""

    def __init__(self, factory: Callable[[], T]):
        self._factory = factory
        self._lock = threading.Lock()
        self._value: T | None = None

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value

    def peek(self) -> T | None:
        """The value if it has been made, else None (without making it)."""
        with self._lock:
            return self._value

    def close(self) -> None:
        """Close the value (when made and closable); a later `get` makes a new one."""
        with self._lock:
            value, self._value = self._value, None
        close = getattr(value, "close", None)
        if callable(close):
            close()
