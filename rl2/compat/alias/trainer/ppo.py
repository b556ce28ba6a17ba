"""`torchrun -m RL2.trainer.ppo key=value ...` (RL2's module path): rl2's PPO trainer, `rl2.trainer.ppo`,
with RL2's keys translated as there."""

from rl2.trainer.ppo import main

if __name__ == "__main__":
    main()
