"""The function-calling demo as a LangGraph agent (`rollout.agent_path`): the task of `envs/demo_tools.py`,
the conversation held by LangGraph's ReAct agent over `ChatOpenAI` pointed at rl2's OpenAI-compatible server.

The agent has one tool, `lookup`, which reads the code of the box the question names; the graph runs the calls
the model makes and asks again, at most two model calls (a recursion limit of 4 graph steps: model, tools,
model, and the ReAct agent's own "need more steps" reply instead of a second round of tools). The final message is scored with the demo's `reward_fn`; rl2 trains on exactly the tokens its engine
sampled for these requests.

    pip install langgraph langchain-openai
    TASK=tools bash recipes/ppo_tiny.sh rollout.agent_path=envs/demo_tools_langgraph.py
"""

import warnings

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError

from demo_lookup import QUESTION, reward_fn, secret_code, tool_reply

with warnings.catch_warnings():  # LangGraph 1.x points to langchain.agents.create_agent, another package
    warnings.simplefilter("ignore")
    from langgraph.prebuilt import create_react_agent


async def run(row: dict, client, *, base_url: str, api_key: str) -> float:
    colour, thing = QUESTION.search(row["messages"][-1]["content"]).groups()

    @tool
    def lookup() -> str:
        """Read the code written on the box the question asks about."""
        return tool_reply(secret_code(colour, thing))

    model = ChatOpenAI(model="rl2", base_url=base_url, api_key=api_key, max_retries=0)
    agent = create_react_agent(model, tools=[lookup])
    try:
        state = await agent.ainvoke({"messages": row["messages"]}, {"recursion_limit": 4})
    except GraphRecursionError:  # it called the tool again instead of answering
        return 0.0
    return reward_fn([{"role": "assistant", "content": state["messages"][-1].content}], row["answer"])
