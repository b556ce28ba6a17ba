"""Env file for math problems: the reward is 1.0 when the final answer of the assistant's last
message equals the dataset row's answer, else 0.0.

The reply should end with its final answer in `\\boxed{...}` (e.g. "... so the area is
\\boxed{\\frac{3}{2}}."); the last box counts. Without a box, the last `<answer>...</answer>` or a
closing "The answer is X." is used. Equivalent forms score 1 (`\\frac{1}{2}` = `0.5`,
`2\\sqrt{2}` = `\\sqrt{8}`, `\\{1,2\\}` = `\\{2,1\\}`, units and `\\%` ignored); see
`rl2.tools.math_grader`.

Grading runs in worker processes (one `MathGrader` per loaded env file) so that a pathological
answer costs its timeout, not the run.
"""

import threading

from rl2.tools.math_grader import MathGrader

WORKERS = 2  # grading processes
TIMEOUT = 5.0  # seconds per answer; a slower one scores 0


class _GraderHolder:
    """The env's one `MathGrader`, made at the first call. A module-level holder is fine here: rl2
    loads each env file as a fresh module, and reward_fn is called from many threads at once, so
    creation is guarded by a lock (a second grader would leak worker processes)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._grader: MathGrader | None = None

    def get(self) -> MathGrader:
        with self._lock:
            if self._grader is None:
                self._grader = MathGrader(workers=WORKERS, timeout=TIMEOUT)
            return self._grader


_holder = _GraderHolder()


def reward_fn(messages: list[dict], answer) -> float:
    return _holder.get().grade(messages[-1]["content"], answer)
