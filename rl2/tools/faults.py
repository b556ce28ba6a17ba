"""Counts of the faults a component recovered from, for the trainer's step metrics.

A component that replaces what died (a grader or sandbox worker, a connection to a service) and
retries the call in flight holds a `FaultCounter` as its `faults` attribute and adds to it, e.g.
`faults.add("grader_restarts")`. `rl2.rollout.env.Env.fault_counts()` sums the counters of an env file's
`Lazy` values (and module-level counters); the PPO trainer logs what each step added as
`faults/<name>`, summed over ranks.
"""

import threading
from collections import Counter


class FaultCounter:
    """Thread-safe running totals of named fault events."""

    def __init__(self):
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def counts(self) -> dict[str, int]:
        """The totals so far, by name."""
        with self._lock:
            return dict(self._counts)

    def __repr__(self) -> str:
        return f"FaultCounter({self.counts()})"
