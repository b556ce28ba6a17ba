"""RL2's `RL2.utils`: only `RL2.utils.communication`, which RL2 HEAD's env files import."""
