"""Native function calling in a rollout: tools from typed functions, calls parsed and run, the model's
mistakes as tool messages, the infrastructure's as env errors, and token-exact trajectories for the chat
templates of the real model families."""

import json
import textwrap

import pytest
from transformers.utils import get_json_schema

from rl2.chat.bridge import bridge_text, rewrites_history
from rl2.chat.template import render_chat
from rl2.chat.tool_parsers import get_tool_parser
from rl2.engines import SamplingParams
from rl2.rollout.env import Env, EnvError
from rl2.rollout.multi_turn import ToolCalling, assign_rewards, rollout
from rl2.rollout.rollout_metrics import rollout_metrics
from rl2.testing.tiny import build_tiny_tokenizer
from scripted_engine import ScriptedEngine

ENV = textwrap.dedent(
    '''
    import time

    from rl2.tools import ToolUnavailable


    def lookup(box: str) -> str:
        """Read the code written on a box.

        Args:
            box: the colour of the box
        """
        if box == "stuck":
            raise ValueError("the box is stuck")
        if box == "offline":
            raise ToolUnavailable("the lookup service is down")
        if box == "slow":
            time.sleep(5)
        return f"code {len(box)}"


    async def add(a: int, b: int) -> int:
        """Add two whole numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b


    TOOLS = [lookup, add]


    def reward_fn(messages, answer):
        return float(messages[-1]["content"].endswith(str(answer)))
    '''
)

FAMILIES = ["chatml", "qwen2.5", "qwen3", "llama3.1", "mistral"]
# Families whose template writes an assistant message's tool_calls (the default ChatML one does not), and
# of them those that render a turn the same whatever follows it (Qwen3 drops an empty reasoning block).
RENDER_CALLS = {"qwen2.5", "qwen3", "llama3.1", "mistral"}
HISTORY_STABLE = RENDER_CALLS - {"qwen3"}
PARSER = {"chatml": "hermes", "qwen2.5": "hermes", "qwen3": "hermes", "llama3.1": "llama3_json", "mistral": "mistral"}


def lookup(box: str) -> str:
    """Read the code written on a box.

    Args:
        box: the colour of the box
    """


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def tokenizer(family):
    return build_tiny_tokenizer(template=family)


@pytest.fixture(scope="module", params=[0, 2], ids=["threads", "workers"])
def env(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "tools_env.py"
    path.write_text(ENV)
    with Env(str(path), timeout=10, tool_timeout=1.0, workers=request.param) as env:
        yield env


def prompt(tokenizer, env, question="What is the code of the red box?", answer="3"):
    messages = [{"role": "user", "content": question}]
    tools = [tool.schema for tool in env.tools.values()]
    text = render_chat(messages, tokenizer, True, tools)
    return {"prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"], "messages": messages,
            "answer": answer, "tools": tools}


def written_call(family: str, tokenizer, calls: list[tuple[str, dict]], content: str = "") -> str:
    """An assistant turn with `calls` (and `content`) as the family's template writes it (what a model
    trained on that template generates), up to its end-of-turn token."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": get_tool_parser(PARSER[family]).call_id(i), "type": "function",
                                  "function": {"name": name, "arguments": arguments}}
                                 for i, (name, arguments) in enumerate(calls)]
    if family not in RENDER_CALLS:  # ChatML: the hermes format, written by hand
        return (content + "\n" if content else "") + "\n".join(
            f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>' for name, arguments in calls)
    stub = [{"role": "user", "content": "hi"}]
    header = render_chat(stub, tokenizer, True)
    rendered = render_chat(stub + [message], tokenizer, False)
    assert rendered.startswith(header)
    turn = rendered[len(header):]
    return turn[: turn.rfind(tokenizer.eos_token)]


# How each family's template marks a tool result: the scripted model's turn is the number of them so far.
TOOL_RESULT = {"chatml": "<|im_start|>tool", "qwen2.5": "<tool_response>", "qwen3": "<tool_response>",
               "llama3.1": "ipython<|end_header_id|>", "mistral": "[TOOL_RESULTS]"}


def scripted(family, tokenizer, turns: list) -> ScriptedEngine:
    """An engine that plays `turns` in order in every conversation (each a list of calls, or the final
    text), telling the turn by the tool results the conversation holds so far."""
    replies = [written_call(family, tokenizer, turn) if isinstance(turn, list)
               else written_call(family, tokenizer, [], turn) if family in RENDER_CALLS else turn for turn in turns]
    return ScriptedEngine(tokenizer, lambda text: replies[min(text.count(TOOL_RESULT[family]), len(replies) - 1)])


def run(family, tokenizer, env, turns, max_turns=3, max_calls=8, answer="3", max_new_tokens=512):
    engine = scripted(family, tokenizer, turns)
    calling = ToolCalling(get_tool_parser(PARSER[family]), max_calls)
    (trajectory,) = rollout(engine, env, tokenizer, [prompt(tokenizer, env, answer=answer)], 1,
                            SamplingParams(max_new_tokens=max_new_tokens),
                            max_turns=max_turns, tool_calling=calling)
    return trajectory, engine


def test_schemas_are_transformers_get_json_schema(env):
    assert list(env.tools) == ["lookup", "add"]
    assert env.tools["lookup"].schema == get_json_schema(lookup)
    assert env.tools["add"].schema["function"]["parameters"]["required"] == ["a", "b"]


def test_a_tool_without_a_usable_docstring_is_a_startup_error_naming_it(tmp_path):
    path = tmp_path / "env.py"
    path.write_text("def search(query: str) -> str:\n    return query\n"
                    "TOOLS = [search]\ndef reward_fn(messages, answer):\n    return 0.0\n")
    with pytest.raises(EnvError, match=r"TOOLS\[0\] \(search\): no JSON schema .* has no docstring"):
        Env(str(path))
    path.write_text("def search(query) -> str:\n    '''Search.\n\n    Args:\n        query: words\n    '''\n"
                    "TOOLS = [search]\ndef reward_fn(messages, answer):\n    return 0.0\n")
    with pytest.raises(EnvError, match=r"search.*missing a type hint"):
        Env(str(path))


def test_calls_run_and_the_trajectory_is_token_exact(family, tokenizer, env):
    calls = [("lookup", {"box": "red"}), ("add", {"a": 2, "b": 3})]
    if family == "llama3.1":
        calls = calls[:1]  # Llama 3.1's template takes one call per message
    trajectory, engine = run(family, tokenizer, env, [calls, "The code is 3"])
    assistant, *results, final = trajectory.messages[1:]
    assert [call["function"] for call in assistant["tool_calls"]] == [
        {"name": name, "arguments": arguments} for name, arguments in calls]
    assert [r["content"] for r in results] == ["code 3", "5"][: len(calls)]
    assert [r["tool_call_id"] for r in results] == [c["id"] for c in assistant["tool_calls"]]
    assert [r["name"] for r in results] == [name for name, _ in calls]
    assert final["role"] == "assistant" and final["content"].strip().endswith("The code is 3")
    assert trajectory.turns == 2 and not trajectory.errors

    # Token-exact: prompt + the generated turn + the bridge + the next generated turn, and the second
    # generation continued exactly the tokens the trajectory holds.
    first_prompt, second_prompt = engine.calls[0][0], engine.calls[1][0]
    first_turn = tokenizer(written_call(family, tokenizer, calls), add_special_tokens=False)["input_ids"]
    first_turn.append(tokenizer.eos_token_id)
    assert second_prompt[: len(first_prompt) + len(first_turn)] == first_prompt + first_turn
    assert trajectory.token_ids[: len(second_prompt)] == second_prompt
    mask = trajectory.action_mask
    assert mask == [0] * len(first_prompt) + [1] * len(first_turn) + [0] * (
        len(second_prompt) - len(first_prompt) - len(first_turn)) + [1] * (len(mask) - len(second_prompt))
    if family in HISTORY_STABLE:  # what the model generated is the template's own rendering: all of it decodes back
        text = tokenizer.decode(trajectory.token_ids, skip_special_tokens=False)
        full = render_chat(trajectory.messages, tokenizer, False, trajectory.tools)
        assert full.startswith(text) and full[len(text):] == full[full.rfind(tokenizer.eos_token) + len(tokenizer.eos_token):]
    assign_rewards(env, [trajectory])
    assert trajectory.reward == 1.0


MODEL_MISTAKES = [
    ([("lookup", {"box": "stuck"})], "Error: lookup raised ValueError: the box is stuck", "lookup"),
    ([("lookup", {"box": 3})], "Error: the arguments of lookup do not match its parameters (argument box): "
                               "3 is not of type 'string'", "lookup"),
    ([("lookup", {})], "Error: the arguments of lookup do not match its parameters: 'box' is a required property",
     "lookup"),
    ([("open", {"box": "red"})], 'Error: there is no tool named "open"; the tools are: "lookup", "add"', "(unknown)"),
    ([("lookup", {"box": "slow"})], "Error: lookup timed out after 1.0s", "lookup"),
]


@pytest.mark.parametrize("calls,message,name", MODEL_MISTAKES, ids=["raised", "type", "missing", "unknown", "hang"])
def test_what_the_model_got_wrong_is_a_tool_message(env, calls, message, name):
    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    trajectory, _ = run("qwen2.5", tokenizer, env, [calls, "The code is 3"])
    assert trajectory.messages[2]["role"] == "tool" and trajectory.messages[2]["content"] == message
    assert not trajectory.errors and trajectory.turns == 2
    metrics = rollout_metrics([trajectory])
    assert metrics[f"tools/{name}/calls"] == 1.0 and metrics[f"tools/{name}/errors"] == 1.0


UNREADABLE_CALLS = [
    ('{"box": "red"}', 'Error: the call to "lookup" is not valid JSON'),  # a brace missing
    ('{"box": ' + "7" * 5000 + "}}", 'Error: the call to "lookup" is not valid JSON: Exceeds the limit (4300 digits)'),
    # past the recursion limit where it is Python's default (1000); a process that raised it (a library may) reads the
    # text and refuses the depth instead: a tool message either way, never an exception
    ('{"box": ' + "[" * 1100 + "]" * 1100 + "}}", ('Error: the call to "lookup" is not valid JSON: it is nested too deeply',
                                                  'Error: the arguments of the call to "lookup" cannot be used: they '
                                                  'are nested deeper than 100 levels')),
    ('{"box": ' + "[" * 200 + "]" * 200 + "}}", 'Error: the arguments of the call to "lookup" cannot be used: they are '
                                                'nested deeper than 100 levels'),
]


@pytest.mark.parametrize("arguments,message", UNREADABLE_CALLS, ids=["json", "huge-integer", "deep-nesting", "too-deep"])
def test_a_call_that_does_not_parse_is_answered_and_its_text_kept(env, arguments, message):
    """Not JSON, an integer past Python's int-string limit, nesting past the recursion limit or past what a tool
    takes: each is a tool message saying so (the model's mistake), the episode goes on, the text is kept."""
    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    broken = f'I will look.\n<tool_call>\n{{"name": "lookup", "arguments": {arguments}\n</tool_call>'
    trajectory, _ = run("qwen2.5", tokenizer, env, [broken, "The code is 3"], max_new_tokens=8192)
    assistant, tool = trajectory.messages[1:3]
    assert "tool_calls" not in assistant and assistant["content"] == broken
    assert tool["role"] == "tool" and tool["content"].startswith(message), tool["content"][:300]  # str or tuple
    assert not trajectory.errors and trajectory.turns == 2
    assert rollout_metrics([trajectory])["tools/lookup/errors"] == 1.0


def test_infrastructure_failure_is_an_env_error_not_a_message(env):
    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    trajectory, engine = run("qwen2.5", tokenizer, env, [[("lookup", {"box": "offline"})], "The code is 3"])
    assert len(engine.calls) == 1 and [m["role"] for m in trajectory.messages] == ["user", "assistant"]
    assert trajectory.excluded and "ToolUnavailable: the lookup service is down" in trajectory.errors[0]
    assert "tools/lookup/calls" not in rollout_metrics([trajectory])


def test_calls_past_max_tool_calls_are_not_run(env):
    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    calls = [("add", {"a": 1, "b": 1}), ("add", {"a": 2, "b": 2}), ("add", {"a": 3, "b": 3})]
    trajectory, _ = run("qwen2.5", tokenizer, env, [calls, "The code is 3"], max_calls=2)
    assert [m["content"] for m in trajectory.messages[2:5]] == [
        "2", "4", "Error: not run: at most 2 tool calls are run per turn"]


def test_a_turn_without_a_call_ends_the_episode(env):
    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    trajectory, engine = run("qwen2.5", tokenizer, env, ["The code is 3"], max_turns=5)
    assert trajectory.turns == 1 and len(engine.calls) == 1 and trajectory.done


def test_qwen3_drops_reasoning_yet_the_trajectory_keeps_what_the_model_saw():
    """Qwen3's template drops an earlier turn's reasoning once a new user message follows (and an empty
    reasoning block once anything follows): the bridge still continues the generated tokens, never raises."""
    tokenizer = build_tiny_tokenizer(template="qwen3")
    assistant = {"role": "assistant", "content": "<think>\nlook first\n</think>\n\nThe code is 3"}
    follow_up = [{"role": "user", "content": "and the blue one?"}]
    assert not rewrites_history(tokenizer, assistant, [{"role": "tool", "content": "x"}])
    assert rewrites_history(tokenizer, assistant, follow_up)
    bridge = bridge_text(tokenizer, assistant, follow_up, None, tokenizer.eos_token)
    assert bridge == "\n<|im_start|>user\nand the blue one?<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------------------------
# rows that carry tools (TRL's dataset convention): SFT warm-ups teach the same format


def write_rows(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_sft_rows_with_tool_calls_learn_the_call_as_the_template_writes_it(tmp_path):
    from rl2.data.conversations import SFTDataset

    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    schema = get_json_schema(lookup)
    call = {"id": "call_0", "type": "function",  # arguments as a JSON string, as OpenAI writes them
            "function": {"name": "lookup", "arguments": json.dumps({"box": "red"})}}
    messages = [{"role": "user", "content": "Code of the red box?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "name": "lookup", "content": "code 3"},
                {"role": "assistant", "content": "The code is 3."}]
    item = SFTDataset(write_rows(tmp_path, [{"messages": messages, "tools": [schema]}]), tokenizer, None)[0]
    trained = tokenizer.decode([t for t, m in zip(item["input_ids"].tolist(), item["loss_mask"].tolist()) if m],
                               skip_special_tokens=False)
    assert trained == ('<tool_call>\n{"name": "lookup", "arguments": {"box": "red"}}\n</tool_call><|im_end|>'
                       "The code is 3.<|im_end|>")
    text = tokenizer.decode(item["input_ids"].tolist(), skip_special_tokens=False)
    assert "<tools>" in text and '"name": "lookup"' in text and "<tool_response>\ncode 3\n</tool_response>" in text


def test_rl_rows_name_the_env_tools_they_may_use(tmp_path, env):
    from rl2.data.conversations import RLDataset
    from rl2.data.rows import DataError

    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    rows = [{"messages": [{"role": "user", "content": "2 + 3?"}], "answer": "5", "tools": ["add"]},
            {"messages": [{"role": "user", "content": "Code of the red box?"}], "answer": "3"}]
    data = RLDataset(write_rows(tmp_path, rows), tokenizer, None, tools=env.tools)
    assert [t["function"]["name"] for t in data[0]["tools"]] == ["add"]
    assert [t["function"]["name"] for t in data[1]["tools"]] == ["lookup", "add"]
    prompt = tokenizer.decode(data[0]["prompt_ids"], skip_special_tokens=False)
    assert '"name": "add"' in prompt and '"name": "lookup"' not in prompt
    rows[1]["tools"] = ["open"]
    with pytest.raises(DataError, match=r"row 2, field 'tools': tools\[0\] names 'open', which the env file's "
                                        r"TOOLS do not define \(lookup, add\)"):
        RLDataset(write_rows(tmp_path, rows), tokenizer, None, tools=env.tools)


# ----------------------------------------------------------------------------------------------
# stateful environments (TRL's environment_factory shape)

STATEFUL_ENV = textwrap.dedent(
    '''
    class Boxes:
        """One per trajectory: counts the lookups it answered."""

        def reset(self, messages, answer):
            self.answer, self.lookups, self.closed = answer, 0, False
            if "hint" in messages[-1]["content"]:
                return "Hint: the lookup tool knows."

        def lookup(self) -> str:
            """Read the code of the box the question is about."""
            self.lookups += 1
            return f"code {self.answer} (lookup {self.lookups})"

        def reward(self) -> float:
            return float(self.lookups == 2)

        def close(self):
            self.closed = True


    ENVIRONMENT = Boxes
    '''
)


@pytest.fixture
def stateful_env(tmp_path):
    path = tmp_path / "boxes.py"
    path.write_text(STATEFUL_ENV)
    with Env(str(path), timeout=10) as env:
        yield env


def test_a_stateful_environment_per_trajectory_scores_and_is_closed(stateful_env, monkeypatch):
    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    assert list(stateful_env.tools) == ["lookup"] and stateful_env.scores_with_environment
    closed = []
    monkeypatch.setattr(stateful_env, "close_environments", lambda instances: closed.extend(instances))
    engine = scripted("qwen2.5", tokenizer, [[("lookup", {})], [("lookup", {})], "The code is 3"])
    calling = ToolCalling(get_tool_parser("hermes"))
    trajectories = rollout(engine, stateful_env, tokenizer, [prompt(tokenizer, stateful_env)], 2, SamplingParams(),
                           max_turns=3, tool_calling=calling)
    first, second = (t.running.environment for t in trajectories)
    assert first is not second and first.answer == "3"
    for trajectory in trajectories:  # each its own count
        assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == [
            "code 3 (lookup 1)", "code 3 (lookup 2)"]
    assign_rewards(stateful_env, trajectories)
    assert [t.reward for t in trajectories] == [1.0, 1.0]
    assert closed == [first, second] and all(t.running is None for t in trajectories)  # the episodes are over


def test_reset_can_add_an_observation_and_an_environment_survives_a_checkpoint(stateful_env):
    from rl2.rollout.trajectory import Trajectory

    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    engine = scripted("qwen2.5", tokenizer, [[("lookup", {})], "The code is 3"])
    row = prompt(tokenizer, stateful_env, question="Code of the box? (hint)")
    (trajectory,) = rollout(engine, stateful_env, tokenizer, [row], 1, SamplingParams(), max_turns=2,
                            tool_calling=ToolCalling(get_tool_parser("hermes")))
    assert trajectory.messages[1] == {"role": "user", "content": "Hint: the lookup tool knows."}
    prompt_text = render_chat(trajectory.messages[:2], tokenizer, True, trajectory.tools)
    assert engine.calls[0][0] == tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    restored = Trajectory.from_dict(json.loads(json.dumps(trajectory.state())))
    assert restored.running.environment.lookups == 1 and restored.running.environment.answer == "3"
    assert restored.token_ids == trajectory.token_ids and trajectory.running.environment is not None


def test_tools_and_environment_together_are_refused(tmp_path):
    path = tmp_path / "both.py"
    path.write_text(STATEFUL_ENV + "\ndef f(x: int) -> int:\n    '''F.\n\n    Args:\n        x: x\n    '''\n"
                    "TOOLS = [f]\n")
    with pytest.raises(EnvError, match="defines both TOOLS and ENVIRONMENT"):
        Env(str(path))


def test_calls_waiting_when_a_step_pauses_run_after_a_checkpoint(env):
    """A partial rollout can pause a trajectory between its calls and their answers: the calls wait in the
    trajectory (through a checkpoint's JSON) and run when it goes on."""
    from rl2.rollout.multi_turn import continue_rollout
    from rl2.rollout.trajectory import Trajectory

    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    engine = scripted("qwen2.5", tokenizer, [[("lookup", {"box": "red"})], "The code is 3"])
    calling = ToolCalling(get_tool_parser("hermes"))
    (trajectory,) = rollout(engine, env, tokenizer, [prompt(tokenizer, env)], 1, SamplingParams(), max_turns=1,
                            tool_calling=calling)
    assert [call["name"] for call in trajectory.running.pending_calls] == ["lookup"]
    trajectory.done, trajectory.running.stage = False, "interact"  # as a pause at its tool calls leaves it
    resumed = Trajectory.from_dict(json.loads(json.dumps(trajectory.state())))
    continue_rollout(engine, env, tokenizer, [resumed], SamplingParams(), max_turns=2, tool_calling=calling)
    assert [m["role"] for m in resumed.messages] == ["user", "assistant", "tool", "assistant"]
    assert resumed.messages[2]["content"] == "code 3" and resumed.turns == 2 and not resumed.running.pending_calls


def test_a_template_without_end_tokens_bridges_only_if_it_keeps_the_turn():
    from rl2.chat.bridge import HistoryRewritten

    tokenizer = build_tiny_tokenizer()
    assistant, tool = {"role": "assistant", "content": "hi"}, [{"role": "tool", "content": "x"}]
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert bridge_text(tokenizer, assistant, tool) == "tool: x\n"
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}"
                               "{% if loop.last %} (last){% endif %}\n{% endfor %}")
    with pytest.raises(HistoryRewritten, match="writes no end-of-turn token"):
        bridge_text(tokenizer, assistant, tool)


def test_pair_rows_are_rendered_with_their_tools(tmp_path):
    from rl2.data.conversations import PairDataset

    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    row = {"messages": [{"role": "user", "content": "Code of the red box?"}], "chosen": "Let me look it up.",
           "rejected": "It is 9.", "tools": json.dumps([get_json_schema(lookup)])}  # a JSON string, as in CSV
    item = PairDataset(write_rows(tmp_path, [row]), tokenizer, None)[0]
    for side, reply in (("chosen", "Let me look it up."), ("rejected", "It is 9.")):
        ids = item[side]["input_ids"].tolist()
        assert '"name": "lookup"' in tokenizer.decode(ids, skip_special_tokens=False)
        trained = [t for t, m in zip(ids, item[side]["loss_mask"].tolist()) if m]
        assert tokenizer.decode(trained, skip_special_tokens=False) == reply + "<|im_end|>"


# ----------------------------------------------------------------------------------------------
# rollout.trajectory_format=per_turn: each turn its own sequence, rendered as the template renders it


FOLLOW_UP_ENV = textwrap.dedent(
    '''
    def interact(messages):
        if sum(m["role"] == "user" for m in messages) == 1:
            return [{"role": "user", "content": "and the blue one?"}]
        return []


    def reward_fn(messages, answer):
        return float(messages[-1]["content"].endswith(str(answer)))
    '''
)


def test_qwen3_with_a_follow_up_user_turn_uses_per_turn_without_error(tmp_path):
    """Qwen3 drops a turn's reasoning once a user message follows it. Per turn, the second turn's sequence
    is the template's rendering of the conversation (the earlier reasoning gone, as at inference), and the
    engine generated from exactly that; the first turn's sequence is its prompt and its tokens."""
    path = tmp_path / "follow_up.py"
    path.write_text(FOLLOW_UP_ENV)
    env = Env(str(path), workers=0)
    tokenizer = build_tiny_tokenizer(template="qwen3")
    replies = ["<think>\nlook first\n</think>\n\nThe code is 3", "<think>\nagain\n</think>\n\nBlue is 4"]
    engine = ScriptedEngine(tokenizer, lambda text: replies[text.count("<|im_start|>user") - 1])
    messages = [{"role": "user", "content": "What is the code of the red box?"}]
    prompt_ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
    row = {"prompt_ids": prompt_ids, "messages": messages, "answer": "4"}
    try:
        (trajectory,) = rollout(engine, env, tokenizer, [row], 1, SamplingParams(), max_turns=3, per_turn=True)
        assign_rewards(env, [trajectory])
    finally:
        env.close()
    assert trajectory.turns == 2 and trajectory.reward == 1.0 and not trajectory.errors
    first, second = trajectory.turn_starts
    assert first == 0
    ids = trajectory.token_ids
    turn_one = tokenizer(replies[0], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids[:second] == prompt_ids + turn_one
    second_prompt = render_chat(trajectory.messages[:3], tokenizer, True)
    assert "look first" not in second_prompt  # as the template shows the conversation at inference
    prompt_two = tokenizer(second_prompt, add_special_tokens=False)["input_ids"]
    assert ids[second:second + len(prompt_two)] == prompt_two
    assert engine.calls[1] == [prompt_two]  # what the model was given is what is trained
    assert trajectory.action_mask[second:] == [0] * len(prompt_two) + [1] * (len(ids) - second - len(prompt_two))
    # the whole conversation as the template renders it, up to the model's end-of-turn token
    assert tokenizer.decode(ids[second:], skip_special_tokens=False) + "\n" == render_chat(trajectory.messages, tokenizer, False)


def test_per_turn_sequences_are_split_and_computed_turn_by_turn():
    """A per-turn trajectory's sequence splits at its turn starts (every field alike); a model's outputs over
    the turns' own sequences join back into one tensor per trajectory; other sequences stay whole."""
    import torch

    from rl2.algorithms.sequences import computed_per_turn, per_turn_sequences, split_turns, turn_start_mask

    per_turn = {"input_ids": torch.arange(7), "loss_mask": torch.tensor([0, 1, 1, 0, 0, 1, 1.0]),
                "turn_starts": turn_start_mask([0, 3], 7)}
    whole = {"input_ids": torch.arange(4), "loss_mask": torch.tensor([0, 1, 0, 1.0])}
    turns = split_turns(per_turn)
    assert [t["input_ids"].tolist() for t in turns] == [[0, 1, 2], [3, 4, 5, 6]]
    assert [t["loss_mask"].tolist() for t in turns] == [[0, 1, 1], [0, 0, 1, 1]]
    assert all("turn_starts" not in t for t in turns) and split_turns(whole) == [whole]
    assert len(per_turn_sequences([per_turn, whole])) == 3
    seen = []

    def compute(sequences, output):  # each sequence's positions, as a model restarting per sequence sees them
        seen.append([len(s["input_ids"]) for s in sequences])
        return [torch.arange(len(s["input_ids"]), dtype=torch.float32) for s in sequences]

    joined = computed_per_turn(compute, [per_turn, whole], "logps")
    assert seen == [[3, 4, 4]]
    assert [j.tolist() for j in joined] == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3]]
