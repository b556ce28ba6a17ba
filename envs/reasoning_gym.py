"""Env file for reasoning-gym tasks: the reward is the task's own score of the final answer of the
last assistant message (reasoning-gym's `score_answer(answer, entry)`, partial credit kept: e.g.
len(gold) / len(answer) for an answer that holds the gold one among other text).

Rows come from `python -m rl2.data.reasoning_gym TASK[,TASK...] --rows N --out train.jsonl`: each
row's answer names its task and holds reasoning-gym's entry (`rl2.data.reasoning_gym`). Needs
reasoning-gym (`pip install 'rl2[envs]'`); without it the file fails to load, saying so.

Setting, from `rollout.env_args` (else the environment variable ANSWER_FORMAT):
- `answer_format`: where the final answer is read: `answer` (default), the last `<answer>...</answer>`;
  `boxed`, the last `\\boxed{...}`. A reply without one scores 0.0. Generate the rows with the same
  `--answer-format`, so that the prompts ask for it.
"""

from rl2.data.reasoning_gym import Scorer
from rl2.rollout.env import EnvArgs

env_args = globals().get("env_args", EnvArgs())  # rollout.env_args, set by rl2 when it loads this file

_score = Scorer(env_args.get("answer_format", "answer"))


def reward_fn(messages: list[dict], answer) -> float:
    return _score(messages, answer)
