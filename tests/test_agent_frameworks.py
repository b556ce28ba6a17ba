"""Agents written with real agent frameworks (the OpenAI Agents SDK, LangGraph) run unchanged against rl2's
OpenAI-compatible server: each framework's requests are served, the tool call the model wrote reaches the
framework's tool, and the trajectory holds every request's tokens exactly as the engine was given and
sampled them, one sequence for the whole conversation. Nothing is trained, and nothing leaves the machine
(the Agents SDK's tracing is disabled, LangSmith's is off).

Each framework runs twice: as its quick-start writes it, and with what else agents commonly send (streaming
with `stream_options`, `tool_choice`, `parallel_tool_calls`, a sampling field, content as a list of parts,
`name` on messages).
"""

import os
import textwrap

import pytest

from rl2.chat.template import render_chat
from rl2.chat.tool_parsers import get_tool_parser
from rl2.engines import SamplingParams
from rl2.rollout.agent_rollout import AgentFile, agent_rollout
from rl2.serve.openai_server import OpenAIServer
from rl2.testing.tiny import build_tiny_tokenizer
from conftest import REPO
from scripted_engine import ScriptedEngine

QUESTION = "What is the code of the red box?"
# The model's two turns: a hermes tool call (as Qwen2.5's template writes one), then, once the
# conversation holds the tool's result, the answer.
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"box": "red"}}\n</tool_call>'
ANSWER = "The red box says code 7."
TOOL_OUTPUT = "the red box says code 7"
REWARD = 0.75  # what the agents return for the right answer (0.25 otherwise): not a default anywhere

# LangGraph 1.x points to langchain.agents.create_agent (another package); create_react_agent still works.
pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")


def need(framework: str) -> None:
    """Skip unless the framework's packages are installed (`pip install openai-agents`, or `langgraph
    langchain-openai`)."""
    for module in {"agents": ["agents"], "langgraph": ["langgraph", "langchain_openai"]}[framework]:
        pytest.importorskip(module)


AGENTS_SDK = '''
    from openai import AsyncOpenAI
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    VARIANT = {variant!r}


    @function_tool
    def lookup(box: str) -> str:
        """Read the code written on a box.

        Args:
            box: the colour of the box
        """
        return f"the {{box}} box says code 7"


    async def run(row, client, *, base_url, api_key):
        question = row["messages"][-1]["content"]
        if VARIANT == "plain":  # the quick-start: a client of its own, Runner.run
            model = OpenAIChatCompletionsModel(
                model="rl2", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))
            agent = Agent(name="boxes", instructions="Answer with the code on the box.", tools=[lookup], model=model)
            result = await Runner.run(agent, input=question)
        elif VARIANT == "responses":  # the SDK's default model: the Responses API, which rl2 does not serve
            agent = Agent(name="boxes", tools=[lookup], model=OpenAIResponsesModel(model="rl2", openai_client=client))
            result = await Runner.run(agent, input=question)
        else:  # the client rl2 gives, streamed, with model settings, the question as content parts
            settings = ModelSettings(tool_choice="auto", parallel_tool_calls=True, temperature=0.7, max_tokens=200,
                                     include_usage=True)
            agent = Agent(name="boxes", instructions="Answer with the code on the box.", tools=[lookup],
                          model=OpenAIChatCompletionsModel(model="rl2", openai_client=client), model_settings=settings)
            result = Runner.run_streamed(
                agent, input=[{{"role": "user", "content": [{{"type": "input_text", "text": question}}]}}])
            async for _ in result.stream_events():
                pass
            assert result.context_wrapper.usage.requests == 2
        return 0.75 if result.final_output == "The red box says code 7." else 0.25
'''

LANGGRAPH = '''
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    VARIANT = {variant!r}


    @tool
    def lookup(box: str) -> str:
        """Read the code written on a box.

        Args:
            box: the colour of the box
        """
        return f"the {{box}} box says code 7"


    async def run(row, client, *, base_url, api_key):
        question = row["messages"][-1]["content"]
        if VARIANT == "plain":  # the quick-start: a ReAct agent, ainvoke
            llm = ChatOpenAI(model="rl2", base_url=base_url, api_key=api_key, max_retries=0)
            agent = create_react_agent(llm, tools=[lookup])
            state = await agent.ainvoke({{"messages": [("user", question)]}})
        elif VARIANT == "responses":  # the Responses API, which rl2 does not serve
            llm = ChatOpenAI(model="rl2", base_url=base_url, api_key=api_key, max_retries=0, use_responses_api=True)
            state = await create_react_agent(llm, tools=[lookup]).ainvoke({{"messages": [("user", question)]}})
        else:  # streamed with usage, tools bound with tool_choice and parallel_tool_calls, named messages, parts
            llm = ChatOpenAI(model="rl2", base_url=base_url, api_key=api_key, max_retries=0, streaming=True,
                             stream_usage=True, temperature=0.5)
            bound = llm.bind_tools([lookup], tool_choice="auto", parallel_tool_calls=False)
            agent = create_react_agent(bound, tools=[lookup], name="boxes",
                                       prompt=SystemMessage(content=[{{"type": "text", "text": "Answer with the code."}}]))
            question = HumanMessage(content=[{{"type": "text", "text": question}}], name="alice")
            async for state in agent.astream({{"messages": [question]}}, stream_mode="values"):
                pass
            assert state["messages"][-1].usage_metadata["output_tokens"] > 0
        return 0.75 if state["messages"][-1].content == "The red box says code 7." else 0.25
'''


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(template="qwen2.5")


@pytest.fixture(scope="module")
def server(tokenizer):
    server = OpenAIServer(tokenizer)
    yield server
    server.close()


@pytest.fixture(autouse=True)
def no_langsmith(monkeypatch):
    """LangChain traces to LangSmith when these say so: never from the tests."""
    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_API_KEY", "LANGCHAIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def run_agent(server, tokenizer, tmp_path, name: str, source: str):
    """One trajectory of the agent file `source` against a model scripted to call `lookup` then answer;
    the trajectory and the engine (its `calls`: the prompts it was given)."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    engine = ScriptedEngine(tokenizer, lambda text: ANSWER if "<tool_response>" in text else CALL)
    messages = [{"role": "user", "content": QUESTION}]
    row = {"prompt_ids": tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"],
           "messages": messages, "answer": "7"}
    (trajectory,) = agent_rollout(server, engine, AgentFile(str(path)), tokenizer, get_tool_parser("hermes"), [row],
                                  1, SamplingParams(max_new_tokens=256), 4, 4096, timeout=60)
    return trajectory, engine


def check_recorded(trajectory, engine, tokenizer):
    """Two requests, one sequence: the first request's prompt and sampled tokens, the tool result bridged
    after them (the sampled ids reused, not re-encoded), the second reply; the model's tokens alone trained."""
    assert trajectory.errors == []
    assert trajectory.turns == 2 and trajectory.turn_starts is None
    assert [len(call) for call in engine.calls] == [1, 1]  # one request generated at a time, two in all
    first_prompt, second_prompt = engine.calls[0][0], engine.calls[1][0]
    eos = tokenizer.eos_token_id
    first_reply = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [eos]
    second_reply = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [eos]
    stats = trajectory.agent_stats
    assert stats["requests"] == 2 and stats["sequences"] == 1 and stats["drift_requests"] == 0
    assert stats["reused_tokens"] == len(first_prompt) + len(first_reply) > 0
    assert second_prompt[: len(first_prompt) + len(first_reply)] == first_prompt + first_reply
    assert trajectory.token_ids == second_prompt + second_reply
    bridge = len(second_prompt) - len(first_prompt) - len(first_reply)
    assert trajectory.action_mask == [0] * len(first_prompt) + [1] * len(first_reply) + [0] * bridge + [1] * len(second_reply)
    assert trajectory.logprobs == [-0.5 if m else 0.0 for m in trajectory.action_mask]
    # The tool's output, as the framework's tool returned it, is in the prompt of the second request.
    bridged = tokenizer.decode(second_prompt[len(first_prompt) + len(first_reply):], skip_special_tokens=False)
    assert f"<tool_response>\n{TOOL_OUTPUT}\n</tool_response>" in bridged
    text = tokenizer.decode(trajectory.token_ids, skip_special_tokens=False)
    assert TOOL_OUTPUT in text
    # Qwen2.5's template only appends: the tokens are the template's rendering of the conversation kept.
    assert render_chat(trajectory.messages, tokenizer, False, trajectory.tools) == text + "\n"
    call, result, answer = trajectory.messages[-3:]
    assert [c["function"] for c in call["tool_calls"]] == [{"name": "lookup", "arguments": {"box": "red"}}]
    assert result["role"] == "tool" and result["tool_call_id"] == call["tool_calls"][0]["id"]
    assert result["content"] == TOOL_OUTPUT and answer == {"role": "assistant", "content": ANSWER}
    assert [tool["function"]["name"] for tool in trajectory.tools] == ["lookup"]


@pytest.mark.parametrize("variant", ["plain", "streamed"])
def test_openai_agents_sdk_agent_runs_unchanged(server, tokenizer, tmp_path, variant):
    need("agents")
    trajectory, engine = run_agent(server, tokenizer, tmp_path, "sdk_agent", AGENTS_SDK.format(variant=variant))
    check_recorded(trajectory, engine, tokenizer)
    assert trajectory.reward == REWARD
    assert trajectory.messages[0] == {"role": "system", "content": "Answer with the code on the box."}
    # The SDK sends each request's temperature from its ModelSettings: ignored (the run's sampling is used), counted.
    assert trajectory.agent_stats.get("ignored_fields") == ({"temperature": 2} if variant == "streamed" else None)


@pytest.mark.parametrize("variant", ["plain", "streamed"])
def test_langgraph_react_agent_runs_unchanged(server, tokenizer, tmp_path, variant):
    need("langgraph")
    trajectory, engine = run_agent(server, tokenizer, tmp_path, "graph_agent", LANGGRAPH.format(variant=variant))
    check_recorded(trajectory, engine, tokenizer)
    assert trajectory.reward == REWARD
    assert trajectory.messages[0]["role"] == ("system" if variant == "streamed" else "user")
    # parallel_tool_calls=false is not enforced (cutting the reply would change the sampled tokens): counted
    ignored = {"temperature": 2, "parallel_tool_calls": 2}
    assert trajectory.agent_stats.get("ignored_fields") == (ignored if variant == "streamed" else None)


@pytest.mark.parametrize("framework", ["agents", "langgraph"])
def test_the_responses_api_is_refused_saying_what_to_use(server, tokenizer, tmp_path, framework):
    need(framework)
    source = AGENTS_SDK if framework == "agents" else LANGGRAPH
    trajectory, engine = run_agent(server, tokenizer, tmp_path, f"{framework}_agent", source.format(variant="responses"))
    (error,) = trajectory.errors
    assert "NotFoundError" in error and "does not serve the Responses API" in error, error
    assert trajectory.reward is None and trajectory.agent_stats["requests"] == 0 and engine.calls == []


@pytest.mark.parametrize("agent", ["demo_tools_agent", "demo_tools_agents_sdk", "demo_tools_langgraph"])
@pytest.mark.parametrize("model", ["answers", "calls_again"])
def test_the_demo_agents_score_the_function_calling_demo(tmp_path, agent, model):
    """The function-calling demo's agents (the OpenAI SDK's, the Agents SDK's, LangGraph's; README) on its
    template: a model that calls lookup() and then gives the code it read scores 1, one exact sequence of two
    requests; one that calls the tool again instead of answering scores 0 (two model calls at most)."""
    need({"demo_tools_agents_sdk": "agents", "demo_tools_langgraph": "langgraph"}.get(agent, "agents"))
    import re

    tokenizer = build_tiny_tokenizer(template="chatml-tools")
    call = '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'

    def reply(text: str) -> str:
        read = re.findall(r"code (\d)", text)
        return f"The code is {read[-1]}." if read and model == "answers" else call

    engine = ScriptedEngine(tokenizer, reply)
    messages = [{"role": "user", "content": "What is the code of the pink eel box?"}]
    row = {"prompt_ids": tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"],
           "messages": messages, "answer": "5"}
    server = OpenAIServer(tokenizer)
    try:
        (trajectory,) = agent_rollout(server, engine, AgentFile(os.path.join(REPO, "envs", f"{agent}.py")), tokenizer,
                                      get_tool_parser("hermes"), [row], 1, SamplingParams(max_new_tokens=48), 2, 4096,
                                      timeout=60)
    finally:
        server.close()
    assert trajectory.errors == [] and trajectory.reward == (1.0 if model == "answers" else 0.0), trajectory.messages
    stats = trajectory.agent_stats
    assert stats["requests"] == 2 and stats["sequences"] == 1 and stats["drift_requests"] == 0
    assert [len(c) for c in engine.calls] == [1, 1] and trajectory.token_ids[:len(engine.calls[1][0])] == engine.calls[1][0]
    assert "code 5 5 5" in tokenizer.decode(trajectory.token_ids)
