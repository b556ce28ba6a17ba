"""The worker process of `rl2.tools.math_grader.MathGrader` (`python -m rl2.tools.grader_worker`):
grades one reply per request with `grade_one`, in its main thread (math-verify's timeouts use
signal.alarm, which works only there).

Request `{"response": str, "gold": str, "timeout": int}`; response `{"score": 1.0 or 0.0, "rule": str}`.
"""

import sys

try:
    import math_verify  # noqa: F401  (imported before the ready frame, so that no call pays for it)
except ModuleNotFoundError as missing:  # the pool quotes our stderr when we do not start
    sys.exit(f"rl2.tools.grader_worker: {missing}: the math grader needs rl2's tools extra (pip install 'rl2[tools]')")

from rl2.tools.math_grader import grade_one
from rl2.tools.worker_pool import serve


def handle(request: dict) -> dict:
    score, rule = grade_one(request["response"], request["gold"], request["timeout"])
    return {"score": score, "rule": rule}


if __name__ == "__main__":
    serve(handle)
