"""The function-calling demo as an agent written with the OpenAI Agents SDK (`rollout.agent_path`): the task
of `envs/demo_tools.py`, the conversation held by the SDK's `Runner` through rl2's OpenAI-compatible server.

The agent has one function tool, `lookup`, which reads the code of the box the question names; the SDK runs
the calls the model makes and asks again, at most two model calls (`max_turns=2`). The final output is scored
with the demo's `reward_fn`; rl2 trains on exactly the tokens its engine sampled for these requests.

    pip install openai-agents
    TASK=tools bash recipes/ppo_tiny.sh rollout.agent_path=envs/demo_tools_agents_sdk.py
"""

from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from demo_lookup import QUESTION, reward_fn, secret_code, tool_reply

set_tracing_disabled(True)  # no traces sent to OpenAI's servers


async def run(row: dict, client) -> float:
    colour, thing = QUESTION.search(row["messages"][-1]["content"]).groups()

    @function_tool
    def lookup() -> str:
        """Read the code written on the box the question asks about."""
        return tool_reply(secret_code(colour, thing))

    agent = Agent(name="boxes", tools=[lookup], model=OpenAIChatCompletionsModel(model="rl2", openai_client=client))
    try:
        result = await Runner.run(agent, input=row["messages"], max_turns=2)
    except MaxTurnsExceeded:  # it called the tool again instead of answering
        return 0.0
    return reward_fn([{"role": "assistant", "content": str(result.final_output)}], row["answer"])
