"""Env file of the function-calling demo: the code of a box is known only to the `lookup` tool, which the
model calls natively (the tool's schema in the chat template, the call parsed into `tool_calls`).

The environment is stateful (TRL's `environment_factory` shape): rl2 makes one `Boxes` per trajectory and
calls `reset` with the row, so the tool knows which box the question is about and the model calls it
without arguments: `<tool_call>{"name": "lookup", "arguments": {}}</tool_call>` (Qwen's format,
`rollout.tool_parser=hermes`). The answer comes back as a tool message; the reward is 1 when the final
reply's last number is the code (`envs/demo_lookup.py`, the same task through `interact`, has the secret
and the reward).
"""

from demo_lookup import QUESTION, reward_fn, secret_code, tool_reply  # noqa: F401  (reward_fn: this file's)


class Boxes:
    """One per trajectory: the box its question asks about."""

    def reset(self, messages: list[dict], answer: str) -> None:
        self.colour, self.thing = QUESTION.search(messages[-1]["content"]).groups()

    def lookup(self) -> str:
        """Read the code written on the box the question asks about."""
        return tool_reply(secret_code(self.colour, self.thing))


ENVIRONMENT = Boxes
