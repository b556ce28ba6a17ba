"""RL2's package name, so RL2's command lines and env files run as written: `torchrun -m RL2.trainer.ppo ...`
runs rl2's PPO trainer (RL2's keys translated, `rl2.config.rl2_keys`), and `from RL2.datasets import ...` /
`from RL2.utils.communication import ...` give rl2's versions of RL2 HEAD's helpers (`rl2.compat.rl2_head_api`).

Installed as the top-level module `RL2` (setup.py's `py_modules`) whose submodules are in `rl2/compat/alias/`
(its `__path__`): a folder `RL2/` beside `rl2/`, in a checkout or in site-packages, would be the same folder as
`rl2/` on a case-insensitive filesystem (macOS, Windows).
"""

import os

from rl2.compat import alias

__path__ = [os.path.dirname(alias.__file__)]
