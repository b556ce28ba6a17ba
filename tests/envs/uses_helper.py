"""An env file that imports a helper module from its own directory."""

from env_helper_lib import extract_number


def reward_fn(messages, answer):
    return float(extract_number(messages[-1]["content"]) == answer)
