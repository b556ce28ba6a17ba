"""An env file whose import fails."""

import rl2_no_such_module_for_tests  # noqa: F401


def reward_fn(messages, answer):
    return 1.0
