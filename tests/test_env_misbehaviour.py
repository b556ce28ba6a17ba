"""An env file's misbehaviour costs one call and is counted: results of its own classes, a gym env that
raises, a huge tool result, a leaking function, daemons it starts, and a call that hangs in thread mode."""

import time

from rl2.rollout.env import Env


def reply(text: str) -> list[dict]:
    return [{"role": "user", "content": "question"}, {"role": "assistant", "content": text}]


def write(folder, name: str, source: str) -> str:
    path = folder / name
    path.write_text(source)
    return str(path)


# Results of classes the env file defines: the trainer cannot import the module a worker loaded it as.
OWN_CLASSES_ENV = """
from dataclasses import dataclass


class Score(float):
    pass


@dataclass
class Reply:
    role: str
    content: str


def reward_fn(messages, answer):
    return Score(0.75)


def interact(messages):
    return [Reply("tool", "hi")]
"""


def test_results_of_the_env_files_own_classes_are_plain_data_or_a_clear_error(tmp_path):
    path = write(tmp_path, "own_classes_env.py", OWN_CLASSES_ENV)
    with Env(path, workers=1, timeout=20.0) as env:
        (scored,) = env.rewards([reply("x")], ["a"])
        (interacted,) = env.interact([reply("x")])
        (again,) = env.rewards([reply("x")], ["a"])  # the worker is fine
    assert scored.value == 0.75 and type(scored.value) is float and scored.error is None and again.value == 0.75
    assert interacted.value == [] and "interact returned a Reply (a class defined in the env file" in interacted.error
