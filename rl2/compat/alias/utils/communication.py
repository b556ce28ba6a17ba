"""RL2's `RL2.utils.communication.async_request`, as RL2 HEAD's env files call it: rl2's version (`rl2.compat.rl2_head_api`)."""

from rl2.compat.rl2_head_api import async_request

__all__ = ["async_request"]
