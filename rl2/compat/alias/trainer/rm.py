"""`torchrun -m RL2.trainer.rm key=value ...` (RL2's module path): rl2's reward model trainer, `rl2.trainer.rm`,
with RL2's keys translated as there."""

from rl2.trainer.rm import main

if __name__ == "__main__":
    main()
