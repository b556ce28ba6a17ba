"""rl2: Ray-less, torchrun-native RL (PPO, GRPO), SFT, reward modelling and DPO for LLMs."""

from rl2.config import Config, load_config
from rl2.trainer.sft import SFTTrainer

__all__ = ["Config", "SFTTrainer", "load_config"]
