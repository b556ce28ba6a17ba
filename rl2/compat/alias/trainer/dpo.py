"""`torchrun -m RL2.trainer.dpo key=value ...` (RL2's module path): rl2's DPO trainer, `rl2.trainer.dpo`,
with RL2's keys translated as there."""

from rl2.trainer.dpo import main

if __name__ == "__main__":
    main()
