"""Env file whose reward is a trained reward model's score of the whole conversation.

    torchrun --nproc_per_node=8 -m rl2.trainer.ppo rollout.env_path=envs/reward_model.py \\
        rollout.env_args.rl2_reward_model=ckpts/rm/step200 ...

`rl2_reward_model` (or the environment variable `RL2_REWARD_MODEL`) is a folder written by `rl2.trainer.rm` (any one-label
`AutoModelForSequenceClassification` folder with a chat template works). Each rank loads it when
the env file is loaded, so a wrong path stops the run at start-up, onto its GPU (or the CPU;
`rl2_reward_device=cpu` forces it). The row's `answer` is not used. `reward_fn` is async, so it
runs in the trainer's process (env worker processes, which run sync functions, would each load a
copy of the model); the scoring itself runs in a thread. A reward model too large to sit
beside the policy is better served by vLLM / SGLang and called over HTTP from `reward_fn`.
"""

import asyncio

from rl2.rollout.env import EnvArgs
from rl2.rollout.reward_scorer import RewardScorer

env_args = globals().get("env_args", EnvArgs())  # rollout.env_args, set by rl2 when it loads this file
if not env_args.get("rl2_reward_model"):
    raise RuntimeError("envs/reward_model.py: set rollout.env_args.rl2_reward_model (or RL2_REWARD_MODEL) to a "
                       "reward model folder, e.g. ckpts/rm/step200")

# Made once per loaded env file (rl2 loads each env file as a fresh module).
_scorer = RewardScorer(env_args.get("rl2_reward_model"), device=env_args.get("rl2_reward_device"))


async def reward_fn(messages: list[dict], answer) -> float:
    return await asyncio.to_thread(_scorer.score, messages)
