"""Env file of the function-calling demo: the code of a box is known only to the `lookup` tool, which the
model calls natively (the tool's schema in the chat template, the call parsed into `tool_calls`).

The model writes `<tool_call>{"name": "lookup", "arguments": {"box": "red fox"}}</tool_call>` (Qwen's
format, `rollout.tool_parser=hermes`); rl2 checks the arguments against the schema made from the
function's type hints and docstring, runs it, and sends its answer back as a tool message. The reward
is 1 when the final reply's last number is the code (`envs/demo_lookup.py`, the same task through
`interact`, has the secret and the reward).
"""

from demo_lookup import reward_fn, secret_code, tool_reply  # noqa: F401  (reward_fn: this file's reward)


def lookup(box: str) -> str:
    """Read the code written on a box.

    Args:
        box: the box as the question names it, colour then animal (e.g. "red fox")
    """
    colour, _, thing = box.strip().partition(" ")
    if not thing:
        raise ValueError(f"no box is named {box!r}: give its colour and animal, e.g. 'red fox'")
    return tool_reply(secret_code(colour, thing))


TOOLS = [lookup]
