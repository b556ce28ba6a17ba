"""RL2's trainer modules (`RL2.trainer.ppo`, `.sft`, `.rm`, `.dpo`): each runs rl2's trainer of the same name."""
