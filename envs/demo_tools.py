"""Env file of the function-calling demo: the code of a box is known only to the `lookup` tool, which the
model calls natively (the tool's schema in the chat template, the call parsed into `tool_calls`).

The model writes `<tool_call>{"name": "lookup", "arguments": {"box": 37}}</tool_call>` (Qwen's
format, `rollout.tool_parser=hermes`); rl2 checks the arguments against the schema made from the
function's type hints and docstring, runs it, and sends its answer back as a tool message. The reward
is 1 when the final reply's last number is the code (`envs/demo_lookup.py`, a harder variant through
`interact`, has the secret and the reward).
"""

from demo_lookup import reward_fn, secret_code, tool_reply  # noqa: F401  (reward_fn: this file's reward)


BOXES = 100  # numbered 0..99: too many codes to learn by heart in a demo, so calling the tool pays


def lookup(box: int) -> str:
    """Read the code written on a box.

    Args:
        box: the box's number
    """
    if not 0 <= box < BOXES:
        raise ValueError(f"there is no box {box}: the boxes are numbered 0 to {BOXES - 1}")
    return tool_reply(secret_code("box", str(box)))


TOOLS = [lookup]
