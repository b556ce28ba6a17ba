"""Requests from many coroutines, fed to one `Engine.generate_turns` call running in another thread.

Each trajectory is a slot of that call: its requests are generated one after the other (the engine's
multi-turn contract: a slot's next turn is a future the engine waits on), so a conversation's turns keep
their order and the engine keeps each slot's cache. A slot ends when its agent is done.
"""

import threading
from collections import deque
from concurrent.futures import Future

from rl2.engines import Generation, Turn


class EngineSlots:
    """`count` slots; `submit` from any thread, `on_generation` and `first_turns` for the engine."""

    def __init__(self, count: int):
        self._lock = threading.Lock()
        self._next: list[Future] = [Future() for _ in range(count)]  # the turn the engine waits for, per slot
        self._waiting: list[deque] = [deque() for _ in range(count)]  # (turn, result) not yet given to it
        self._current: list[Future | None] = [None] * count  # the result of the turn being generated
        self._closed = [False] * count

    def first_turns(self) -> list[Future]:
        return list(self._next)

    def submit(self, slot: int, turn: Turn) -> "Future[Generation]":
        """A future of the generation of `turn`, queued behind the slot's earlier requests."""
        result: Future = Future()
        start = None
        with self._lock:
            if self._closed[slot]:
                raise RuntimeError(f"slot {slot} is closed: its agent is done")
            if self._current[slot] is None and not self._next[slot].done():
                self._current[slot], start = result, self._next[slot]
            else:
                self._waiting[slot].append((turn, result))
        if start is not None:
            start.set_result(turn)
        return result

    def on_generation(self, slot: int, generation: Generation) -> Future:
        """The engine finished the slot's turn: hand it to its request; the slot's next turn."""
        upcoming: Future = Future()
        with self._lock:
            finished, self._current[slot] = self._current[slot], None
            self._next[slot] = upcoming
            turn = None
            if self._waiting[slot]:
                turn, self._current[slot] = self._waiting[slot].popleft()
            ends = turn is None and self._closed[slot]
        if turn is not None:
            upcoming.set_result(turn)
        elif ends:
            upcoming.set_result(None)
        if finished is not None:
            finished.set_result(generation)
        return upcoming

    def close(self, slot: int) -> None:
        """The slot's agent is done: once its queued requests are generated, the engine lets it go."""
        end = None
        with self._lock:
            self._closed[slot] = True
            if self._current[slot] is None and not self._waiting[slot] and not self._next[slot].done():
                end = self._next[slot]
        if end is not None:
            end.set_result(None)
