"""A correct sync env: reward 1.0 when the last message is the answer; interact echoes until "bye"."""


def reward_fn(messages, answer):
    return float(messages[-1]["content"] == str(answer))


def interact(messages):
    last = messages[-1]["content"]
    if last == "bye":
        return []
    return [{"role": "tool", "content": f"echo: {last}", "tool_call_id": "call-1"}]
