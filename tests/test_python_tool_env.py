"""envs/python_tool.py (rStar2-Agent's code tool): call parsing, output formatting, the local
sandbox and the code service behind `interact`, an executor that cannot run programs (an env
error, never a tool message), and the env end to end through the rollout."""

import asyncio
import json
import os
import re
import time

import pytest
from aiohttp import web
from transformers import AutoTokenizer

from conftest import tokenize_prompt
from rl2.engines import SamplingParams
from rl2.rollout.env import Env
from rl2.rollout.env_file import load_env_file
from rl2.rollout.multi_turn import assign_rewards, rollout
from rl2.tools.lazy import Lazy
from rl2.tools.sandbox import RunResult
from scripted_engine import ScriptedEngine
from server_process import ServerProcess, free_port, serving

ENV_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "envs", "python_tool.py")


@pytest.fixture(scope="module")
def tool():
    module = load_env_file(ENV_PATH)
    yield module
    if module._sandbox._value is not None:
        module._sandbox.get().close()


@pytest.fixture(autouse=True)
def fresh_code_client(tool):
    """Each test's CODE_SERVER_URL gets a client of its own (the env makes one at first use)."""
    tool._code_client.close()
    yield
    tool._code_client.close()


def call(code: str, **extra) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code, **extra}}) + "\n</tool_call>"


def test_parse_python_calls(tool):
    text = "Let me check. " + call("print(1)") + " and " + call("print(input())", input="x") + " done"
    assert tool.parse_python_calls(text) == [("print(1)", ""), ("print(input())", "x")]
    assert tool.parse_python_calls("no call here, \\boxed{3}") == []
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(2)\\"}"}</tool_call>'
    assert tool.parse_python_calls(as_string) == [("print(2)", "")]
    (bad_json,) = tool.parse_python_calls("<tool_call>{'name': 'python'}</tool_call>")
    assert bad_json.startswith("Error: the tool call is not valid JSON")
    (unknown,) = tool.parse_python_calls('<tool_call>{"name": "bash", "arguments": {"code": "ls"}}</tool_call>')
    assert "unknown tool 'bash'" in unknown
    (no_code,) = tool.parse_python_calls('<tool_call>{"name": "python", "arguments": {"program": "x"}}</tool_call>')
    assert '"code"' in no_code
    assert tool.parse_python_calls(call("print(1)") + "<tool_call>{\"name\"")[1] == (
        "Error: a <tool_call> is not closed with </tool_call>.")


def test_format_and_shorten(tool):
    assert tool.format_result("4\n", "", "ok", 4, 100) == "4"
    assert tool.format_result("", "", "ok", 4, 100) == "(no output)"
    error = tool.format_result("partial\n", "Traceback ...\nZeroDivisionError: division by zero\n", "error", 4, 100)
    assert error.startswith("partial\nTraceback") and error.endswith("ZeroDivisionError: division by zero")
    assert "did not finish within 4 seconds" in tool.format_result("", "", "timeout", 4, 100)
    assert tool.format_result("", "HTTP 413: too large", "tool_error", 4, 100) == "Tool error: HTTP 413: too large"
    long = tool.format_result("a" * 500 + "END", "", "ok", 4, 60)
    assert long.startswith("a" * 40) and long.endswith("END") and "characters cut" in long and len(long) < 120


def run(coro):
    return asyncio.run(coro)


def test_interact_with_the_local_sandbox(tool, monkeypatch):
    monkeypatch.delenv("CODE_SERVER_URL", raising=False)
    monkeypatch.setenv("PYTHON_TOOL_TIMEOUT", "1")
    monkeypatch.setenv("PYTHON_TOOL_MAX_CHARS", "200")
    content = (call("print(sum(range(10)))") + call("1/0") + "<tool_call>{oops}</tool_call>"
               + call("while True: pass") + call("print('z' * 5000)") + call("print(input()[::-1])", input="abc"))
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": content}]
    start = time.monotonic()
    replies = run(tool.interact(messages))
    assert time.monotonic() - start < 3.0  # the calls ran concurrently, the loop was cut at 1 s
    assert [r["role"] for r in replies] == ["tool"] * 6
    texts = [r["content"] for r in replies]
    assert texts[0] == "45"
    assert texts[1].endswith("ZeroDivisionError: division by zero") and 'File "solution.py"' in texts[1]
    assert texts[2].startswith("Error: the tool call is not valid JSON")
    assert "did not finish within 1 seconds" in texts[3]
    assert "characters cut" in texts[4] and len(texts[4]) < 260
    assert texts[5] == "cba"
    assert run(tool.interact(messages + [{"role": "assistant", "content": "So \\boxed{45}."}])) == []


def test_too_many_calls_in_one_turn(tool, monkeypatch):
    monkeypatch.delenv("CODE_SERVER_URL", raising=False)
    monkeypatch.setenv("PYTHON_TOOL_MAX_CALLS", "2")
    replies = run(tool.interact([{"role": "assistant", "content": "".join(call(f"print({i})") for i in range(4))}]))
    assert [r["content"] for r in replies] == ["0", "1", "Error: at most 2 tool calls are run per turn; 2 were skipped."]


def test_interact_with_the_code_service(tool, monkeypatch):
    server = ServerProcess("rl2.tools.code_server", ["--host", "127.0.0.1", "--port", "0", "--workers", "2",
                                                     "--timeout", "2"], r"code service ready at (http://\S+)",
                           "code server")
    try:
        monkeypatch.setenv("CODE_SERVER_URL", server.wait_ready())
        monkeypatch.setenv("PYTHON_TOOL_TIMEOUT", "1")
        messages = [{"role": "assistant", "content": call("print(6*7)") + call("import sys; sys.exit('boom')")
                     + call("import time; time.sleep(10)")}]
        texts = [r["content"] for r in run(tool.interact(messages))]
        assert texts[0] == "42" and texts[1].endswith("boom") and "did not finish" in texts[2]
        assert tool._code_client.get().faults.counts() == {}
    finally:
        server.kill()


def test_unreachable_code_service_is_an_env_error(tool, monkeypatch):
    """A program the service could not run after the client's retries makes interact raise, naming
    the URL and the cause; through rl2.rollout.env it is an env error and the retries are counted."""
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("CODE_SERVER_URL", url)
    monkeypatch.setenv("CODE_SERVER_RETRIES", "2")
    messages = [{"role": "assistant", "content": call("print(1)") + call("print(2)")}]
    start = time.monotonic()
    with pytest.raises(tool.ToolUnavailable) as error:
        run(tool.interact(messages))
    assert time.monotonic() - start < 10  # backoff 0.5 + 1 s and refused connections
    assert str(error.value).startswith(f"the code service at {url} could not run 2 of 2 program(s): "
                                       f"code service at {url} unreachable")
    assert "gave up after 3 attempts" in str(error.value)
    assert tool._code_client.get().faults.counts() == {"code_service_retries": 2}

    with Env(ENV_PATH, timeout=30, need_interact=True) as env:
        (result,) = env.interact([messages])
        assert env.fault_counts() == {"code_service_retries": 2}
    assert result.value == [] and result.error.startswith(f"interact raised ToolUnavailable: the code service at {url}")


def test_code_service_answers(tool, monkeypatch):
    """queue_timeout after the retries and a URL without a code service: env errors; a program the
    service refuses (too large): a tool message."""
    calls = {"busy": 0}

    async def busy(request):
        calls["busy"] += 1
        subs = (await request.json())["submissions"]
        return web.json_response({"sub_id": "x", "results": [
            {"sub_id": s["sub_id"], "success": False, "run_success": False, "cost": 4.0, "stdout": "",
             "stderr": "no worker free within 4s", "reason": "queue_timeout"} for s in subs]})

    async def too_large(request):
        return web.json_response({"detail": "Request Entity Too Large"}, status=413)

    app = web.Application()
    app.router.add_post("/busy/run/long-batch", busy)
    app.router.add_post("/small/run/long-batch", too_large)
    messages = [{"role": "assistant", "content": call("print(1)")}]
    monkeypatch.setenv("CODE_SERVER_RETRIES", "1")

    async def answers(url: str):
        monkeypatch.setenv("CODE_SERVER_URL", url)
        tool._code_client.close()
        try:
            return await tool.interact(messages)
        except tool.ToolUnavailable as error:
            return error

    async def main():
        async with serving(app) as url:
            return await answers(url + "/busy"), await answers(url + "/small"), await answers(url + "/nowhere"), url

    busy_error, refused, missing, url = run(main())
    assert isinstance(busy_error, tool.ToolUnavailable) and calls["busy"] == 2
    assert str(busy_error) == (f"the code service at {url}/busy could not run 1 of 1 program(s): "
                               "no worker free within 4s")
    (message,) = refused
    assert message["content"].startswith(f"Tool error: code service at {url}/small rejected the request with HTTP 413")
    assert isinstance(missing, tool.ToolUnavailable) and "HTTP 404" in str(missing)


class StubSandbox:
    """Answers every program with a fixed `RunResult` reason (as the sandbox does)."""

    def __init__(self, reason: str, stderr: str):
        self.reason, self.stderr = reason, stderr

    async def run_async(self, code: str, stdin: str = "") -> RunResult:
        if code == "print('fine')":
            return RunResult("fine\n", "", 0, 0.01, "ok")
        return RunResult("", self.stderr, None, 0.01, self.reason)


def test_local_sandbox_that_cannot_run_a_program_is_an_env_error(tool, monkeypatch):
    monkeypatch.delenv("CODE_SERVER_URL", raising=False)
    monkeypatch.setattr(tool, "_sandbox", Lazy(lambda: StubSandbox("sandbox_error", "its worker died twice")))
    messages = [{"role": "assistant", "content": call("print('fine')") + call("print(2)")}]
    with pytest.raises(tool.ToolUnavailable, match=re.escape(
            "the local sandbox could not run 1 of 2 program(s): its worker died twice")):
        run(tool.interact(messages))


@pytest.mark.parametrize("reason,stderr,expected", [
    ("error", "Traceback (most recent call last):\nValueError: x\n", "Traceback (most recent call last):\n"
     "ValueError: x"),
    ("memory", "MemoryError\n", "MemoryError"),
    ("timeout", "", "TimeoutError: the program did not finish within 4 seconds."),
    ("output_limit", "", "[output cut: the program printed too much]"),
])
def test_what_a_program_did_is_a_tool_message(tool, monkeypatch, reason, stderr, expected):
    monkeypatch.delenv("CODE_SERVER_URL", raising=False)
    monkeypatch.delenv("PYTHON_TOOL_TIMEOUT", raising=False)
    monkeypatch.setattr(tool, "_sandbox", Lazy(lambda: StubSandbox(reason, stderr)))
    replies = run(tool.interact([{"role": "assistant", "content": call("print('fine')") + call("x")}]))
    assert [r["content"] for r in replies] == ["fine", expected]


def test_end_to_end_through_the_rollout(tiny_model_dir, monkeypatch):
    """A scripted model calls the tool, reads the real output and answers; the math reward scores it."""
    monkeypatch.delenv("CODE_SERVER_URL", raising=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def reply(conversation: str) -> str:  # answers once the tool's output is in the conversation
        if "385" not in conversation:
            return "I will compute it. " + call("print(sum(i * i for i in range(1, 11)))")
        return "The sum of squares is \\boxed{385}."

    messages = [{"role": "system", "content": "Use the python tool."},
                {"role": "user", "content": "What is 1^2 + ... + 10^2?"}]
    prompts = [{"prompt_ids": tokenize_prompt(messages, tokenizer), "messages": messages, "answer": "385"}]
    with Env(ENV_PATH, timeout=30, need_interact=True) as env:
        (trajectory,) = rollout(ScriptedEngine(tokenizer, reply), env, tokenizer, prompts, 1, SamplingParams(),
                                max_turns=3)
        assign_rewards(env, [trajectory])
    roles = [m["role"] for m in trajectory.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory.messages[3]["content"] == "385"
    assert trajectory.reward == 1.0 and trajectory.done


def test_the_tool_schema_is_what_rl2_makes_of_the_function(tool):
    from transformers.utils import get_json_schema

    assert tool.TOOL_SCHEMA == get_json_schema(tool.python) and tool.TOOLS == [tool.python]
    assert json.dumps(tool.TOOL_SCHEMA) in tool.SYSTEM_PROMPT
