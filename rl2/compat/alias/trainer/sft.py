"""`torchrun -m RL2.trainer.sft key=value ...` (RL2's module path): rl2's SFT trainer, `rl2.trainer.sft`,
with RL2's keys translated as there."""

from rl2.trainer.sft import main

if __name__ == "__main__":
    main()
