"""rStar2-Agent's code tool, reduced to what talks to a code-judge server: the program its
`generate_tool_call_code` wraps a tool call in, the `/run/long-batch` request of
`run_tool_calls_on_server_async` (resubmitting queue timeouts), and the text the model is shown.

Source: github.com/microsoft/rStar, `rstar2_agent/tools/code_judge_utils.py` (MIT licence,
Copyright (c) Microsoft Corporation). Rewritten here with the same behaviour, so the tests see what
that client sees:
- the program replays a Jupyter-like session: earlier cells run first with their output discarded
  (and their errors ignored), then the new cell; a cell that ends in an expression prints its repr;
- an error in the new cell is printed to stderr as "<Type> at line <n>: <message>\\n  <line>" (or
  "<Type>: <message>") and the program leaves with `os._exit(1)`;
- `python_code_with_standard_io` runs one cell with the call's stdin; `jupyter_code` sends no stdin
  (input null);
- success text: "Tool call success", then "stdout: ..." / "stderr: ..." when not empty, then
  "execution time: <cost>s"; failure text: "Tool call failure", "reason: <reason>", then the same.
"""

import base64
import json

import requests

# The program every tool call runs as: a persistent executor fed base64-encoded cells.
PROGRAM_HEAD = '''
import ast
import base64
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO


def describe(error, code, line_offset=0):
    lineno = getattr(error, "lineno", None)
    if lineno is None:
        tb = error.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        lineno = tb.tb_lineno if tb is not None else -1
    if lineno != -1:
        lineno += line_offset
        lines = code.splitlines()
        if 0 <= lineno - 1 < len(lines):
            return f"{type(error).__name__} at line {lineno}: {error}\\n  {lines[lineno - 1]}"
    return f"{type(error).__name__}: {error}"


class Session:
    def __init__(self):
        self.env = {"__name__": "__main__", "__file__": "<string>", "__builtins__": __builtins__}

    def run_cell(self, code, replay):
        quiet = StringIO()
        out = redirect_stdout(quiet if replay else sys.stdout)
        err = redirect_stderr(quiet if replay else sys.stderr)
        try:
            tree = ast.parse(code)
        except SyntaxError as error:
            return self.fail(describe(error, code), replay)
        body, last = code, None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            node = tree.body[-1]
            lines = code.splitlines()
            body = "\\n".join(lines[:node.lineno - 1])
            last = "\\n".join(lines[node.lineno - 1:node.end_lineno])
        if body:
            try:
                with out, err:
                    exec(compile(body, "<string>", "exec"), self.env)
            except Exception as error:
                return self.fail(describe(error, body), replay)
        if last:
            try:
                with out, err:
                    value = eval(compile(last, "<string>", "eval"), self.env)
                if value is not None and not replay:
                    print(repr(value))
            except Exception:
                try:
                    with out, err:
                        exec(compile(last, "<string>", "exec"), self.env)
                except Exception as error:
                    return self.fail(describe(error, last, len(body.splitlines()) if body else 0), replay)

    def fail(self, message, replay):
        if replay:
            return
        print(message, file=sys.stderr)
        os._exit(1)


session = Session()
'''

PROGRAM_CELL = '\nsession.run_cell(base64.b64decode("{}").decode(), replay={})\n'


def _encoded(code: str) -> str:
    return base64.b64encode(code.encode()).decode()


def tool_program(code: str, history: list[str] = ()) -> str:
    """The program a tool call runs: the session, the earlier cells replayed quietly, then `code`."""
    cells = [PROGRAM_CELL.format(_encoded(cell), True) for cell in history]
    return PROGRAM_HEAD + "".join(cells) + PROGRAM_CELL.format(_encoded(code), False)


def submission(tool_call: dict) -> dict:
    """The code-judge submission of a `jupyter_code` or `python_code_with_standard_io` call."""
    arguments = tool_call["arguments"]
    if tool_call["name"] == "jupyter_code":
        history = [call["arguments"]["code"] for call in tool_call.get("history_tool_calls", [])
                   if call["name"] == "jupyter_code"]
        return {"type": "python", "solution": tool_program(arguments["code"], history), "input": None}
    if tool_call["name"] == "python_code_with_standard_io":
        return {"type": "python", "solution": tool_program(arguments["code"]), "input": arguments["input"]}
    raise ValueError(f"Unsupported tool call name: {tool_call['name']}")


def run_tool_calls(url: str, tool_calls: list[dict], max_retries: int = 4) -> list[str]:
    """POST the calls to `<url>/run/long-batch`, resubmitting queue timeouts; the model's view of each."""
    pending = list(enumerate(submission(call) for call in tool_calls))
    results: list[dict | None] = [None] * len(tool_calls)
    for _ in range(max_retries):
        if not pending:
            break
        answer = requests.post(f"{url}/run/long-batch", json={"type": "batch", "submissions": [s for _, s in pending]},
                               timeout=60)
        answer.raise_for_status()
        again = []
        for (index, sub), result in zip(pending, answer.json()["results"]):
            if result["reason"] == "queue_timeout":
                again.append((index, sub))
            else:
                results[index] = result
        pending = again
    if pending:
        raise RuntimeError(f"{len(pending)} tool calls failed after {max_retries} attempts: {json.dumps(pending)[:200]}")
    return [tool_text(result) for result in results]


def tool_text(result: dict) -> str:
    """What the model is shown for one code-judge result."""
    if result["run_success"] and result["success"]:
        parts = ["Tool call success"]
    else:
        parts = ["Tool call failure", f"reason: {result['reason']}"]
    if result["stdout"]:
        parts.append(f"stdout: {result['stdout']}")
    if result["stderr"]:
        parts.append(f"stderr: {result['stderr']}")
    parts.append(f"execution time: {result['cost']:.2f}s")
    return "\n".join(parts)
