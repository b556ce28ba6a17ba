"""envs/python_tool.py (rStar2-Agent's code tool): call parsing, output formatting, the local
sandbox and the code service behind `interact`, and the env end to end through the rollout."""

import asyncio
import os
import time

import pytest
from transformers import AutoTokenizer

from rl2.data import tokenize_prompt
from rl2.engines import SamplingParams
from rl2.env import Env, _load_module
from rl2.rollout import assign_rewards, rollout
from scripted_engine import ScriptedEngine
from server_process import ServerProcess

ENV_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "envs", "python_tool.py")


@pytest.fixture(scope="module")
def tool():
    module = _load_module(ENV_PATH)
    yield module
    if module._sandbox._value is not None:
        module._sandbox.get().close()


def call(code: str, **extra) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code, **extra}}) + "\n</tool_call>"


def test_parse_tool_calls(tool):
    text = "Let me check. " + call("print(1)") + " and " + call("print(input())", input="x") + " done"
    assert tool.parse_tool_calls(text) == [("print(1)", ""), ("print(input())", "x")]
    assert tool.parse_tool_calls("no call here, \\boxed{3}") == []
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(2)\\"}"}</tool_call>'
    assert tool.parse_tool_calls(as_string) == [("print(2)", "")]
    (bad_json,) = tool.parse_tool_calls("<tool_call>{'name': 'python'}</tool_call>")
    assert bad_json.startswith("Error: the tool call is not valid JSON")
    (unknown,) = tool.parse_tool_calls('<tool_call>{"name": "bash", "arguments": {"code": "ls"}}</tool_call>')
    assert "unknown tool 'bash'" in unknown
    (no_code,) = tool.parse_tool_calls('<tool_call>{"name": "python", "arguments": {"program": "x"}}</tool_call>')
    assert '"code"' in no_code
    assert tool.parse_tool_calls(call("print(1)") + "<tool_call>{\"name\"")[1] == (
        "Error: a <tool_call> is not closed with </tool_call>.")


def test_format_and_shorten(tool):
    assert tool.format_result("4\n", "", "ok", 4, 100) == "4"
    assert tool.format_result("", "", "ok", 4, 100) == "(no output)"
    error = tool.format_result("partial\n", "Traceback ...\nZeroDivisionError: division by zero\n", "error", 4, 100)
    assert error.startswith("partial\nTraceback") and error.endswith("ZeroDivisionError: division by zero")
    assert "did not finish within 4 seconds" in tool.format_result("", "", "timeout", 4, 100)
    assert tool.format_result("", "service down", "tool_error", 4, 100) == "Tool error: service down"
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
    finally:
        server.kill()
    start = time.monotonic()
    (dead,) = run(tool.interact([{"role": "assistant", "content": call("print(1)")}]))
    assert dead["content"].startswith("Tool error:") and "unreachable" in dead["content"]
    assert time.monotonic() - start < 30


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
