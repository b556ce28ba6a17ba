"""A single-turn env: reward_fn and no interact."""


def reward_fn(messages, answer):
    return 0.5
