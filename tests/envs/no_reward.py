"""An env file that forgot reward_fn."""


def interact(messages):
    return []
