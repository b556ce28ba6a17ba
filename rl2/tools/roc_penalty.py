"""GRPO-RoC's default penalty of a trajectory (rStar2-Agent): tool errors plus answer-format errors.

Lower is better; `rl2.algorithms.resample_on_correct.resample_on_correct` keeps the positive trajectories of a group
by it. Written for the messages of envs/python_tool.py; an env file may define its own
`roc_penalty(messages)` instead.
"""

import re

from rl2.tools.math_grader import closing_brace

# How a tool message of envs/python_tool.py reports an error (for `roc_penalty`); any match counts.
# Anchored forms, so that a program which merely prints the word "error" does not count.
ROC_ERROR_MARKERS = (
    # The env's own messages: a malformed call ("Error: the tool call is not valid JSON ...", "Error:
    # unknown tool ...", "Error: a <tool_call> is not closed ..."), calls skipped over the per-turn limit
    # ("Error: at most 8 tool calls ..."), and a program the executor refused ("Tool error: ...", e.g. too large).
    re.compile(r"\A(?:Error|Tool error): "),
    # An uncaught exception's traceback (also "Exception Group Traceback (most recent call last):").
    re.compile(r"Traceback \(most recent call last\):"),
    # An exception's last line, also where there is no traceback header (a SyntaxError raised while
    # compiling the program) or where the env cut the header out of a long output:
    # "ZeroDivisionError: division by zero", "MemoryError", "numpy.linalg.LinAlgError: ...", and the
    # env's timeout message "TimeoutError: the program did not finish within 4 seconds.".
    re.compile(r"^(?:\w+\.)*(?:\w+Error|\w*Exception)(?::|$)", re.MULTILINE),
)
# The final answer tag of our math envs (envs/python_tool.py asks for \boxed{}; the grader also reads \fbox{}).
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)


def roc_tool_error(content: str) -> bool:
    """Whether a tool message of envs/python_tool.py reports an error: a traceback or an exception line
    (a failed program, a timeout, running out of memory), or one of the env's own "Error: " / "Tool
    error: " messages. Output cut for length ("[output cut: ...]") and a program that fails without
    writing to stderr (`sys.exit(1)`) do not count."""
    return any(marker.search(content) for marker in ROC_ERROR_MARKERS)


def _count_answers(text: str) -> tuple[int, bool]:
    """(complete \\boxed{} / \\fbox{} answers in `text`, whether one is left unclosed), outside tool calls.

    Braces are matched as the grader (`rl2.tools.math_grader`) does, escaped ones skipped; a box
    inside a complete one is not counted again; "\\boxed 5" counts as complete.
    """
    text = _TOOL_CALL_BLOCK.sub("", text)
    count, unclosed, i = 0, False, 0
    while (match := _BOX_COMMAND.search(text, i)) is not None:
        i = match.end()
        if text.startswith(" ", i) and re.match(r" +[^\s$]", text[i:]):
            count += 1
            continue
        if not text.startswith("{", i):
            unclosed = True
            continue
        end = closing_brace(text, i)
        if end is None:
            unclosed = True
        else:
            count, i = count + 1, end + 1
    return count, unclosed


def roc_penalty(messages: list[dict]) -> float:
    """GRPO-RoC's penalty of one trajectory (lower is better): p_err + p_format, in [0, 2].

    p_err: the share of its tool messages (role "tool") that report an error (`roc_tool_error`), 0.5
    when it made no tool call. p_format: 1 when the last assistant message has no complete final
    answer (our envs' `\\boxed{}`, or `\\fbox{}`) or leaves one unclosed; otherwise
    min((answers - 1) / turns, 1), with answers counted over all assistant messages (outside tool
    calls) and turns the number of assistant messages.
    """
    p_err, p_format = roc_penalty_parts(messages)
    return p_err + p_format


def roc_penalty_parts(messages: list[dict]) -> tuple[float, float]:
    """(p_err, p_format) of `roc_penalty`."""
    tool_replies = [message.get("content") or "" for message in messages if message.get("role") == "tool"]
    if tool_replies:
        p_err = sum(roc_tool_error(reply) for reply in tool_replies) / len(tool_replies)
    else:
        p_err = 0.5
    turns = [_count_answers(message.get("content") or "") for message in messages if message.get("role") == "assistant"]
    if not turns or turns[-1][0] == 0 or turns[-1][1]:
        return p_err, 1.0
    answers = sum(count for count, _ in turns)
    return p_err, min((answers - 1) / len(turns), 1.0)


def roc_error_rates(conversations: list[list[dict]]) -> tuple[float, float]:
    """(share of all tool messages that report an error, share of conversations whose last
    assistant message has no well-formed final answer) — GRPO-RoC's logged error rates."""
    replies = [m.get("content") or "" for messages in conversations for m in messages if m.get("role") == "tool"]
    tool_error_rate = sum(roc_tool_error(reply) for reply in replies) / len(replies) if replies else 0.0
    malformed = 0
    for messages in conversations:
        turns = [m.get("content") or "" for m in messages if m.get("role") == "assistant"]
        count, unclosed = _count_answers(turns[-1]) if turns else (0, True)
        malformed += count == 0 or unclosed
    return tool_error_rate, malformed / max(len(conversations), 1)
