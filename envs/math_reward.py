"""Env file for math problems: the reward is 1.0 when the final answer of the assistant's last
message equals the dataset row's answer, else 0.0.

The reply should end with its final answer in `\\boxed{...}` (e.g. "... so the area is
\\boxed{\\frac{3}{2}}."); the last box counts. Without a box, the last `<answer>...</answer>` or a
closing "The answer is X." is used. Equivalent forms score 1 (`\\frac{1}{2}` = `0.5`,
`2\\sqrt{2}` = `\\sqrt{8}`, `\\{1,2\\}` = `\\{2,1\\}`, units and `\\%` ignored); see
`rl2.tools.math_grader`.

Grading runs in worker processes (one `MathGrader` per loaded env file) so that a pathological
answer costs its timeout, not the run. An answer that could not be graded (it took longer than
TIMEOUT, or its worker process kept dying) is not scored 0: `reward_fn` raises the grader's
`GradingError`, and rl2 counts the call as an env error and leaves the trajectory out of training.
A worker that dies is replaced and the answer graded again; the grader's `faults` count it.
"""

from rl2.tools.lazy import Lazy
from rl2.tools.math_grader import MathGrader

WORKERS = 2  # grading processes
TIMEOUT = 5.0  # seconds per answer; a slower one raises GradingError

# Made at the first call, once per loaded env file (rl2 loads each env file as a fresh module).
_grader = Lazy(lambda: MathGrader(workers=WORKERS, timeout=TIMEOUT))


def reward_fn(messages: list[dict], answer) -> float:
    return _grader.get().grade(messages[-1]["content"], answer)
