"""Env file for math with a Python tool (rStar2-Agent): the model reasons, calls a Python
interpreter as often as it needs, and ends with its answer in \\boxed{...}.

The tool is the typed function `python(code, input)` in `TOOLS` (native function calling): its schema
goes into the chat template, and the model calls it in its own format, any number of times in one turn
(Qwen's, `rollout.tool_parser=hermes`):

    <tool_call>
    {"name": "python", "arguments": {"code": "print(sum(range(10)))"}}
    </tool_call>

rl2 parses the calls, checks their arguments, runs them concurrently and sends one tool message per call
(stdout; stderr or the timeout when the program failed; cut to a length limit); a turn without a call
ends the trajectory. `interact` does the same from the text for RL2's protocol (an env file without
TOOLS; a copy of this file without them). `reward_fn` is the math reward (`envs/math_reward.py`) on
the last message.

Programs run in rl2's local sandbox (`rl2.tools.sandbox`) or, when `CODE_SERVER_URL` is set, on a
code-judge-compatible service (`python -m rl2.tools.code_server`, or code-judge itself) through one
`CodeClient` per loaded env file. Both replace what died and retry (the sandbox its workers, the
client its requests, riding out a service restart of a few seconds), counting it in the step's
`faults/*` metrics. A program the executor still could not run makes `interact` raise
`ToolUnavailable`: an env error (the trajectory is left out of training), never a tool message the
model would learn from. What a program did (its output, an error, a timeout, running out of memory)
is always a tool message.

Settings, from `rollout.env_args` in lower case (code_server_url, ...) or else the environment: CODE_SERVER_URL, PYTHON_TOOL_TIMEOUT (seconds per program, 4),
PYTHON_TOOL_MAX_CHARS (tool output kept, 1024), PYTHON_TOOL_MAX_CALLS (calls run per turn, 8),
PYTHON_TOOL_WORKERS (local sandbox workers, 4), PYTHON_TOOL_MEMORY_MB (1024), CODE_SERVER_RETRIES
(retries of a failed request to the code service, 6: about 24 s of backoff), CODE_SERVER_API_KEY (sent as
`Authorization: Bearer <key>` to a service started with --api-key). The sandbox's and the
client's settings are read when they are first used.

With a chat template that has no place for tools (the tiny models' ChatML), put `SYSTEM_PROMPT` first in
the prompts (as the system message) so the model knows the tool.
"""

import asyncio
import json
import re

from rl2.tools import ToolUnavailable, code_client
from rl2.tools.lazy import Lazy
from rl2.tools.math_grader import MathGrader
from rl2.tools.code_server import TIMEOUT_LINE
from rl2.tools.sandbox import Sandbox
from rl2.rollout.env import EnvArgs

env_args = globals().get("env_args", EnvArgs())  # rollout.env_args, set by rl2 when it loads this file

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
UNCLOSED_CALL = re.compile(r"<tool_call>(?!.*</tool_call>)", re.DOTALL)
NOT_RUN = ("internal_error", "queue_timeout")  # code-judge's (and the client's) reasons for a program that did not run


def _setting(name: str, default: float) -> float:
    """`rollout.env_args.<name>`, else the environment variable NAME, else `default`."""
    return env_args.get(name, default)


_sandbox = Lazy(lambda: Sandbox(workers=_setting("python_tool_workers", 4),
                                timeout=_setting("python_tool_timeout", 4.0),
                                memory_mb=_setting("python_tool_memory_mb", 1024)))
_grader = Lazy(lambda: MathGrader(workers=2, timeout=5.0))
# Made on first use when CODE_SERVER_URL is set; one per loaded env file, so its fault counts persist.
_code_client = Lazy(lambda: code_client.CodeClient(_setting("code_server_url", ""),
                                                   timeout=_setting("python_tool_timeout", 4.0) + 30,
                                                   retries=_setting("code_server_retries", code_client.RETRIES),
                                                   api_key=_setting("code_server_api_key", None)))


def parse_python_calls(text: str) -> list[tuple[str, str] | str]:
    """Each `<tool_call>` of `text` in order: (code, stdin) for a valid python call, otherwise a
    message saying what is wrong with it."""
    calls: list[tuple[str, str] | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(f"Error: the tool call is not valid JSON ({error.msg} at position {error.pos}). "
                         'Write <tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>.')
            continue
        arguments = call.get("arguments") if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models send the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or call.get("name") != "python":
            name = call.get("name") if isinstance(call, dict) else None
            calls.append(f"Error: unknown tool {name!r}; the only tool is \"python\".")
        elif not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
            calls.append('Error: the python tool needs "arguments": {"code": "<program>"}.')
        else:
            stdin = arguments.get("input", "")
            calls.append((arguments["code"], stdin if isinstance(stdin, str) else str(stdin)))
    if UNCLOSED_CALL.search(text):
        calls.append("Error: a <tool_call> is not closed with </tool_call>.")
    return calls


def shorten(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters, keeping its start and its end (where errors are)."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n... [{len(text) - limit} characters cut] ...\n{text[-tail:] if tail else ''}"


def format_result(stdout: str, stderr: str, status: str, timeout: float, limit: int) -> str:
    """The tool message for one program. `status`: ok, error, timeout, memory, output_limit or
    tool_error (the executor refused this program, e.g. too large; `stderr` says why)."""
    if status == "tool_error":
        return shorten(f"Tool error: {stderr.strip() or 'the code executor failed'}", limit)
    parts = [stdout] if stdout else []
    if status == "timeout":
        parts.append(f"TimeoutError: the program did not finish within {timeout:g} seconds.")
    elif status in ("error", "memory") and stderr:
        parts.append(stderr)
    elif status == "output_limit":
        parts.append("[output cut: the program printed too much]")
    text = "\n".join(p.rstrip("\n") for p in parts)
    return shorten(text, limit) if text else "(no output)"


def _status_from_judge(result: dict) -> str:
    """Our status for a code-judge result dict of a program that ran, or that the service refused
    (`rl2.tools.code_client`'s "invalid_input"): code-judge's `reason` is "" when the program ran,
    or "worker_timeout"."""
    reason = result.get("reason") or ""
    if reason == "invalid_input":
        return "tool_error"
    if reason == "worker_timeout":
        return "timeout"
    return "ok" if result.get("run_success") else "error"


def _not_run(executor: str, problems: list[str], total: int) -> ToolUnavailable:
    return ToolUnavailable(f"{executor} could not run {len(problems)} of {total} program(s): "
                           f"{problems[0].strip() or 'no reason given'}")


async def run_programs(programs: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(stdout, stderr, status) for each (code, stdin), on the code service or the local sandbox;
    raises `ToolUnavailable` when the executor could not run one of them."""
    if _setting("code_server_url", ""):
        client = _code_client.get()
        results = await client.run_many(programs)
        problems = [r.get("stderr") or r["reason"] for r in results if r.get("reason") in NOT_RUN]
        if problems:
            raise _not_run(f"the code service at {client.url}", problems, len(results))
        # code-judge ends a timed-out program's stdout with its own line; our message says it instead
        return [((r.get("stdout") or "").removesuffix(TIMEOUT_LINE), r.get("stderr") or "", _status_from_judge(r))
                for r in results]
    sandbox = _sandbox.get()
    results = await asyncio.gather(*(sandbox.run_async(code, stdin) for code, stdin in programs))
    problems = [r.stderr or r.reason for r in results if r.reason == "sandbox_error"]
    if problems:
        raise _not_run("the local sandbox", problems, len(results))
    return [(r.stdout, r.stderr, r.reason) for r in results]


async def python(code: str, input: str = "") -> str:
    """Run a Python 3 program and return what it prints (stdout, and stderr if it fails). Each call starts fresh: define everything you use. Print the values you want to see.

    Args:
        code: The complete program.
        input: Text given to the program on stdin (optional).
    """
    ((stdout, stderr, status),) = await run_programs([(code, input)])
    return format_result(stdout, stderr, status, timeout=_setting("python_tool_timeout", 4.0),
                         limit=_setting("python_tool_max_chars", 1024))


TOOLS = [python]
# What rl2 makes of `python`'s hints and docstring (transformers' get_json_schema; a test holds them equal),
# written out for SYSTEM_PROMPT so that this file's env workers need not import transformers.
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 program and return what it prints (stdout, and stderr if it fails). "
        "Each call starts fresh: define everything you use. Print the values you want to see.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The complete program."},
                "input": {"type": "string", "description": "Text given to the program on stdin (optional)."},
            },
            "required": ["code"],
        },
        "return": {"type": "string"},
    },
}

SYSTEM_PROMPT = (
    "You are a helpful assistant that solves math problems step by step. You may run Python code to "
    "compute or check intermediate results.\n\n# Tools\n\nYou may call one or more functions to assist with "
    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    f"{json.dumps(TOOL_SCHEMA)}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
    "Put your final answer within \\boxed{}."
)


async def interact(messages: list[dict]) -> list[dict]:
    """RL2's text protocol: runs the calls written in the assistant's last message (rl2 calls it only for
    a turn in which the native parser found none, and then it finds none either)."""
    last = messages[-1]
    if last.get("role") != "assistant":
        return []
    calls = parse_python_calls(last.get("content") or "")
    if not calls:
        return []
    max_calls = _setting("python_tool_max_calls", 8)
    limit = _setting("python_tool_max_chars", 1024)
    timeout = _setting("python_tool_timeout", 4.0)
    skipped = calls[max_calls:]
    calls = calls[:max_calls]
    programs = [call for call in calls if isinstance(call, tuple)]
    outputs = iter(await run_programs(programs)) if programs else iter(())
    replies = []
    for call in calls:
        if isinstance(call, str):
            replies.append(call)
        else:
            replies.append(format_result(*next(outputs), timeout=timeout, limit=limit))
    if skipped:
        replies.append(f"Error: at most {max_calls} tool calls are run per turn; {len(skipped)} were skipped.")
    return [{"role": "tool", "content": reply} for reply in replies]


def reward_fn(messages: list[dict], answer) -> float:
    return _grader.get().grade(messages[-1]["content"], answer)
