"""A first agent written with the OpenAI SDK (`rollout.agent_path`, docs/guides/agents.md): it shows the model an
`add` tool, runs the calls the model makes and sends their results back (at most two requests), then scores the
last reply against the row's answer. `client` is rl2's OpenAI-compatible server over the policy being trained:
what trains is exactly the tokens sampled for these requests. The rows: recipes/data/calculator.jsonl.

    pip install -e ".[agents]"
    python -m rl2.testing.tiny my_model --template qwen2.5
    torchrun --nproc_per_node=2 -m rl2.trainer.ppo rollout.agent_path=envs/calculator_agent.py \\
        data.path=recipes/data/calculator.jsonl actor.model_name=my_model rollout.max_turns=2 ...
"""

import json

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def add(a: int, b: int) -> int:
    return a + b


def tool_result(arguments: str) -> str:
    """What the `add` tool answers to a call's arguments (a JSON string): the sum, or what was wrong."""
    try:
        return str(add(**json.loads(arguments)))
    except (TypeError, ValueError) as error:  # arguments that are not JSON, or not a and b
        return f"error: {error}"


async def run(row: dict, client) -> float:
    """One trajectory: ask with the tool; run its calls and ask again; 1.0 when the last reply holds the answer."""
    messages = list(row["messages"])
    for turn in range(2):
        reply = await client.chat.completions.create(model="rl2", messages=messages, tools=[ADD])
        message = reply.choices[0].message
        messages.append({"content": "", **message.model_dump(exclude_none=True)})  # a call alone has no content
        if not message.tool_calls or turn == 1:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": tool_result(call.function.arguments)})
    return float(row["answer"] in messages[-1]["content"])
