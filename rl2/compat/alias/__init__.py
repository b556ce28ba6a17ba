"""The modules of RL2's package name `RL2` (`rl2/compat/RL2.py` makes this folder its `__path__`):
`RL2.trainer.ppo`, `.sft`, `.rm`, `.dpo` run rl2's trainers; `RL2.datasets` and `RL2.utils.communication` hold
rl2's versions of the RL2 HEAD helpers its env files import (`rl2.compat.rl2_head_api`)."""
