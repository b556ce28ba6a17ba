"""rl2: Ray-less, torchrun-native RL (PPO, GRPO), SFT, reward modelling and DPO for LLMs."""

import importlib

# name -> module; imported on first use so `python -m rl2.trainer.sft` does not import itself twice.
_EXPORTS = {
    "Config": "rl2.config",
    "load_config": "rl2.config",
    "SFTTrainer": "rl2.trainer.sft",
    "PPOTrainer": "rl2.trainer.ppo",
    "PPOEvaluator": "rl2.trainer.ppo_eval",
    "RMTrainer": "rl2.trainer.rm",
    "DPOTrainer": "rl2.trainer.dpo",
    "RewardScorer": "rl2.rollout.reward_scorer",
    "Env": "rl2.rollout.env",
    "HFEngine": "rl2.engines",
    "SamplingParams": "rl2.engines",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rl2' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The exports too (imported on first use), so that tab completion and `dir(rl2)` show them."""
    return sorted({*globals(), *_EXPORTS})
