"""An RL2 HEAD env file in the shape of RL2's envs/orz.py: math-verify's parse / verify called directly in an
async env_step (they time out with signal.alarm: only in a main thread), through RL2's base_generate."""

import logging
from functools import partial
from typing import Any

from math_verify import parse, verify

from RL2.datasets import Sample, base_generate

for name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(name).disabled = True


async def env_step(sample: Sample) -> dict[str, Any]:
    gold, given = parse(sample.sample["answer"]), parse(sample.action_text)
    return {"next_state": None, "done": True, "reward": float(verify(gold, given))}


generate = partial(base_generate, env_step_fn=env_step)
