"""An env file with a syntax error on line 3 (the missing colon)."""

def reward_fn(messages, answer)
    return 1.0
