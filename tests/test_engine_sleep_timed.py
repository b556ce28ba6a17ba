"""The engine's sleep after a rollout counts in the step's time (`time/sync`): on SGLang it releases the engine's
memory, seconds a step on CPU, which `time/step` (the sum of the phases) left out."""

import time
from types import SimpleNamespace

from transformers import AutoTokenizer

from conftest import counting_prompts as prompts
from rl2.engines import SamplingParams
from rl2.metrics import PhaseTimer
from rl2.rollout.env import Env
from rl2.rollout.partial import PartialRollout
from rl2.rollout.service import RolloutService
from test_partial_rollout import GROUP, TickEngine, service

SLEEP = 0.3


class SlowSleepEngine(TickEngine):
    def sleep(self):
        time.sleep(SLEEP)


def reward_env(tmp_path):
    path = tmp_path / "env.py"
    path.write_text("def reward_fn(messages, answer):\n    return 1.0\n")
    return Env(str(path), workers=0)


def test_the_sleep_after_a_rollout_is_timed_as_sync(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with reward_env(tmp_path) as env:
        rollout = RolloutService.__new__(RolloutService)  # what generate uses of it
        rollout.__dict__.update(service(SlowSleepEngine(lambda prompt: 3), env, tokenizer).__dict__,
                                agent=None, rl2_head=None, images=None)
        rollout.rollout_config.trajectory_format = "whole"
        timer = PhaseTimer()
        trajectories = rollout.generate(prompts(tokenizer, 2), SamplingParams(max_new_tokens=4), GROUP, seed=0,
                                        timer=timer, sleep_after=True)
        assert len(trajectories) == 2 * GROUP
        assert timer.times["sync"] >= SLEEP and timer.times["rollout"] < SLEEP

        partial = PartialRollout(service(SlowSleepEngine(lambda prompt: 3), env, tokenizer), 2, 0, 2, GROUP)
        timer = PhaseTimer()
        partial.generate(prompts(tokenizer, 2), SamplingParams(max_new_tokens=4), seed=0, version=0, timer=timer,
                         sleep_after=True)
        assert timer.times["sync"] >= SLEEP and timer.times["rollout"] < SLEEP

        timer = PhaseTimer()  # an engine kept resident does not sleep
        rollout.generate(prompts(tokenizer, 2), SamplingParams(max_new_tokens=4), GROUP, seed=0, timer=timer)
        assert "sync" not in timer.times
