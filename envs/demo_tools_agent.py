"""The function-calling demo as an agent written with the OpenAI SDK (`rollout.agent_path`): the same task as
`envs/demo_tools.py`, but the conversation is the agent's own, held through rl2's OpenAI-compatible server.

The agent shows the model the `lookup` tool, runs the calls the model makes and sends their results back,
for at most two requests, then scores the final reply with the demo's `reward_fn`. rl2 trains on exactly
the tokens its engine sampled for these requests.

    TASK=tools bash recipes/ppo_tiny.sh rollout.agent_path=envs/demo_tools_agent.py
"""

from demo_lookup import QUESTION, reward_fn, secret_code, tool_reply

# The schema transformers' get_json_schema gives envs/demo_tools.py's Boxes.lookup (what the warm-up rows show).
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Read the code written on the box the question asks about.",
    "parameters": {"type": "object", "properties": {}}, "return": {"type": "string"}}}


async def run(row: dict, client) -> float:
    messages = list(row["messages"])
    colour, thing = QUESTION.search(messages[-1]["content"]).groups()
    for turn in range(2):
        reply = await client.chat.completions.create(model="rl2", messages=messages, tools=[LOOKUP])
        message = reply.choices[0].message
        messages.append({"content": "", **message.model_dump(exclude_none=True)})  # a call alone has no content
        if not message.tool_calls or turn == 1:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": tool_reply(secret_code(colour, thing))})
    return reward_fn(messages, row["answer"])
