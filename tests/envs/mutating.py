"""Functions that mutate what they are given (the trajectory must not see it)."""

SHARED_REPLY = [{"role": "tool", "content": "shared"}]


def reward_fn(messages, answer):
    messages[-1]["content"] = "changed"
    messages.append({"role": "user", "content": "extra"})
    answer.clear()
    return 1.0


def interact(messages):
    messages.clear()
    return SHARED_REPLY  # the same list object every call
