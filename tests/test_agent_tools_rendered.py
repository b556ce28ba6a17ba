"""An agent's `tools` that the chat template would drop from the prompt (rl2.testing.tiny's default ChatML renders
none) are refused with a 400 naming the template and the fix, instead of training on prompts that never showed
them; a template that renders tools serves the same request."""

import textwrap

import pytest

from rl2.chat.template import render_chat, template_renders_tools
from rl2.chat.tool_parsers import get_tool_parser
from rl2.engines import SamplingParams
from rl2.rollout.agent_rollout import AgentFile, agent_rollout
from rl2.serve.openai_server import OpenAIServer
from rl2.serve.session import AgentSession, RequestError
from rl2.testing.tiny import build_tiny_tokenizer
from scripted_engine import ScriptedEngine

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Read the code written on a box.",
                                           "parameters": {"type": "object", "properties": {}}}}
AGENT = f'''
async def run(row, client):
    reply = await client.chat.completions.create(model="rl2", messages=row["messages"], tools=[{LOOKUP!r}])
    return 1.0
'''
QUESTION = [{"role": "user", "content": "What is the code?"}]


def test_which_templates_render_tools():
    assert not template_renders_tools(build_tiny_tokenizer())  # ChatML: tools and tool calls are not rendered
    for family in ("qwen2.5", "chatml-tools", "llama3.1"):
        assert template_renders_tools(build_tiny_tokenizer(template=family)), family


def test_a_request_whose_tools_the_template_drops_is_refused():
    tokenizer = build_tiny_tokenizer()
    session = AgentSession(tokenizer, get_tool_parser("hermes"))
    with pytest.raises(RequestError, match=r"does not render tools.*--template qwen2\.5"):
        session.plan(QUESTION, [LOOKUP])
    assert session.plan(QUESTION, None).prompt_ids  # without tools it is served
    rendering = build_tiny_tokenizer(template="qwen2.5")
    plan = AgentSession(rendering, get_tool_parser("hermes")).plan(QUESTION, [LOOKUP])
    assert "lookup" in rendering.decode(plan.prompt_ids) and "lookup" in render_chat(QUESTION, rendering, True, [LOOKUP])


@pytest.mark.parametrize("template, refused", [("chatml", True), ("qwen2.5", False)])
def test_the_agent_gets_a_400_naming_the_template_and_the_fix(template, refused, tmp_path):
    pytest.importorskip("openai")
    tokenizer = build_tiny_tokenizer(template=template)
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(AGENT))
    row = {"messages": QUESTION, "answer": "3",
           "prompt_ids": tokenizer(render_chat(QUESTION, tokenizer, True), add_special_tokens=False)["input_ids"]}
    server = OpenAIServer(tokenizer)
    try:
        (trajectory,) = agent_rollout(server, ScriptedEngine(tokenizer, lambda text: "3"), AgentFile(str(path)),
                                      tokenizer, get_tool_parser("hermes"), [row], 1,
                                      SamplingParams(max_new_tokens=8), 4, 4096)
    finally:
        server.close()
    if refused:
        assert trajectory.reward is None and len(trajectory.errors) == 1, trajectory.errors
        assert "400" in trajectory.errors[0] and "does not render tools" in trajectory.errors[0]
        assert "--template qwen2.5" in trajectory.errors[0]
    else:
        assert trajectory.reward == 1.0 and not trajectory.errors
