"""Env file whose reward is a trained reward model's score of the whole conversation.

    RL2_REWARD_MODEL=ckpts/rm/step200 torchrun --nproc_per_node=8 -m rl2.trainer.ppo \\
        rollout.env_path=envs/reward_model.py ...

`RL2_REWARD_MODEL` is a folder written by `rl2.trainer.rm` (any one-label
`AutoModelForSequenceClassification` folder with a chat template works). Each rank loads it when
the env file is loaded, so a wrong path stops the run at start-up, onto its GPU (or the CPU;
`RL2_REWARD_DEVICE=cpu` forces it). The row's `answer` is not used. A reward model too large to sit
beside the policy is better served by vLLM / SGLang and called over HTTP from `reward_fn`.
"""

import os

from rl2.rollout.reward_scorer import RewardScorer

if not os.environ.get("RL2_REWARD_MODEL"):
    raise RuntimeError("envs/reward_model.py: set RL2_REWARD_MODEL to a reward model folder, e.g. ckpts/rm/step200")

# Made once per loaded env file (rl2 loads each env file as a fresh module).
_scorer = RewardScorer(os.environ["RL2_REWARD_MODEL"], device=os.environ.get("RL2_REWARD_DEVICE"))


def reward_fn(messages: list[dict], answer) -> float:
    return _scorer.score(messages)
