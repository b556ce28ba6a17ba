"""Helpers for writing env files (e.g. `math_grader` for math answers)."""


class ToolUnavailable(Exception):
    """Raised by a tool when the infrastructure behind it failed (a dead service, a full queue): the call
    is an env error (the trajectory is left out of training), never a tool message the model learns from."""
