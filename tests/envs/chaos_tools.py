"""Env file of the chaos test: every reward runs a program in the sandbox and grades its output with
the math grader, so both worker pools serve every call. The reward is 1.0 exactly when the reply's
length is even: the program prints the answer, plus one for an odd length."""

from rl2.tools.lazy import Lazy
from rl2.tools.math_grader import MathGrader
from rl2.tools.sandbox import Sandbox

_sandbox = Lazy(lambda: Sandbox(workers=2, timeout=10.0))
_grader = Lazy(lambda: MathGrader(workers=2, timeout=10.0))


def reward_fn(messages: list[dict], answer: str) -> float:
    reply = messages[-1]["content"]
    # The sleep keeps the workers busy long enough for some kills to land mid-call.
    run = _sandbox.get().run(f"import time\ntime.sleep(0.1)\nprint({int(answer)} + {len(reply) % 2})")
    if not run.ok:
        raise RuntimeError(f"the program did not run: {run.reason}: {run.stderr[-300:]}")
    return _grader.get().grade(f"\\boxed{{{run.stdout.strip()}}}", answer)
