"""The turn limit (`rollout.max_turns`) and the length limits end an episode that is then scored as it stands,
never dropped as an env error: a policy that never answers must be penalised. Every multi-turn path: an env
file's `interact`, its `TOOLS`, a gym-style `make_env` (whose episode a turn cut by max_new_tokens does not
end: only the environment, the turn limit or the sequence length limit do), and agents over the OpenAI API
(their default request budget included)."""

import textwrap

import pytest

from rl2.chat.template import render_chat
from rl2.chat.tool_parsers import get_tool_parser
from rl2.config import load_config
from rl2.engines import SamplingParams
from rl2.rollout.env import Env
from rl2.rollout.multi_turn import ToolCalling, assign_rewards, rollout
from rl2.rollout.rollout_metrics import rollout_metrics
from rl2.testing.tiny import build_tiny_tokenizer
from scripted_engine import ScriptedEngine
from server_process import REPO

# Never answers: it asks its tool again and again. Unanswered, the reward is -1; an answer scores 1.
INTERACT = '''
def interact(messages):
    return [{"role": "tool", "content": "still searching"}]


def reward_fn(messages, answer):
    last = messages[-1]
    if last["role"] != "assistant" or "<answer>" not in last["content"]:
        return -1.0
    return 1.0
'''

TOOLS = '''
def search(query: str) -> str:
    """Search the notes.

    Args:
        query: what to look for
    """
    return "nothing yet"


TOOLS = [search]


def reward_fn(messages, answer):
    last = messages[-1]
    return -1.0 if last.get("tool_calls") or "<answer>" not in last["content"] else 1.0
'''

CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "code"}}\n</tool_call>'


def env_file(tmp_path, source: str) -> Env:
    path = tmp_path / "env.py"
    path.write_text(textwrap.dedent(source))
    return Env(str(path), workers=0, need_interact=True)


def row(tokenizer, tools=None) -> dict:
    messages = [{"role": "user", "content": "What is the code?"}]
    ids = tokenizer(render_chat(messages, tokenizer, True, tools), add_special_tokens=False)["input_ids"]
    return {"prompt_ids": ids, "messages": messages, "answer": "3", "tools": tools}


@pytest.mark.parametrize("per_turn", [False, True], ids=["whole", "per_turn"])
def test_interact_episode_at_the_turn_limit_is_scored(tmp_path, per_turn):
    """An episode whose model never answers ends at rollout.max_turns and reward_fn scores the conversation so
    far (-1 here), with no env error: it trains, penalised."""
    tokenizer = build_tiny_tokenizer()
    env = env_file(tmp_path, INTERACT)
    engine = ScriptedEngine(tokenizer, lambda text: "<search>code</search>")
    try:
        trajectories = rollout(engine, env, tokenizer, [row(tokenizer)], 2, SamplingParams(), max_turns=3,
                               per_turn=per_turn)
        assign_rewards(env, trajectories)
    finally:
        env.close()
    assert [t.turns for t in trajectories] == [3, 3] and sum(len(call) for call in engine.calls) == 6
    assert [t.reward for t in trajectories] == [-1.0, -1.0]
    assert [t.errors for t in trajectories] == [[], []] and not any(t.excluded for t in trajectories)
    assert [m["role"] for m in trajectories[0].messages] == ["user"] + ["assistant", "tool"] * 2 + ["assistant"]
    metrics = rollout_metrics(trajectories)
    assert metrics["env_errors"] == 0.0 and metrics["excluded"] == 0.0 and metrics["reward/mean"] == -1.0


def test_function_calling_episode_at_the_turn_limit_is_scored(tmp_path):
    """With TOOLS, a last turn that calls a tool at the turn limit is not run; reward_fn scores the conversation
    ending with that call (-1), no env error."""
    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    env = env_file(tmp_path, TOOLS)
    tools = [tool.schema for tool in env.tools.values()]
    engine = ScriptedEngine(tokenizer, lambda text: CALL)
    try:
        (trajectory,) = rollout(engine, env, tokenizer, [row(tokenizer, tools)], 1, SamplingParams(), max_turns=2,
                                tool_calling=ToolCalling(get_tool_parser("hermes")))
        assign_rewards(env, [trajectory])
    finally:
        env.close()
    assert trajectory.turns == 2 and trajectory.reward == -1.0 and trajectory.errors == []
    assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.messages[-1]["tool_calls"][0]["function"]["name"] == "search"
    assert [call["name"] for call in trajectory.tool_stats] == ["search"]  # the last turn's call was not run


def test_interact_episode_at_the_sequence_length_limit_is_scored(tmp_path):
    """An episode cut by the sequence length limit (data.max_length) is scored as it stands too."""
    tokenizer = build_tiny_tokenizer()
    env = env_file(tmp_path, INTERACT)
    engine = ScriptedEngine(tokenizer, lambda text: "<search>code</search>")
    prompt = row(tokenizer)
    try:
        (trajectory,) = rollout(engine, env, tokenizer, [prompt], 1, SamplingParams(), max_turns=8,
                                max_length=len(prompt["prompt_ids"]) + 40)
        assign_rewards(env, [trajectory])
    finally:
        env.close()
    assert trajectory.truncated and 1 <= trajectory.turns < 8
    assert trajectory.reward == -1.0 and trajectory.errors == []


def test_openenv_turns_cut_by_max_new_tokens_go_on_and_the_turn_limit_is_scored(word_chain_url):
    """An OpenEnv game (a gym-style environment over HTTP): replies cut by max_new_tokens are the server's
    actions and the game goes on; the one stopped by rollout.max_turns before the server says done is scored
    with its steps' rewards, not an env error."""
    tokenizer = build_tiny_tokenizer()
    env = Env(f"{REPO}/envs/openenv.py", workers=0, need_interact=True,
              args={"openenv_url": word_chain_url, "observation_field": "prompt", "reset_fields": ["letters"]})
    messages = [{"role": "user", "content": "Let us play."}]
    ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
    rows = [{"prompt_ids": ids, "messages": messages, "answer": None, "row": {"letters": letters}}
            for letters in ("abc", "abcdef")]
    # Every reply is cut at 4 tokens: "apple" then a long tail; the game asks for words starting with a, b, c...
    engine = ScriptedEngine(tokenizer, lambda text: "alpha beta gamma delta epsilon zeta eta theta")
    try:
        finished, at_limit = rollout(engine, env, tokenizer, rows, 1, SamplingParams(max_new_tokens=4), max_turns=4)
        assign_rewards(env, [finished, at_limit])
    finally:
        env.close()
    assert finished.turns == 3 and finished.step_rewards == [1.0, 0.0, 0.0] and finished.reward == 1.0
    assert at_limit.turns == 4 and at_limit.step_rewards == [1.0, 0.0, 0.0, 0.0] and at_limit.reward == 1.0
    assert finished.errors == [] and at_limit.errors == [] and at_limit.truncated
    assert len(engine.calls) and all(m["content"].startswith("alpha") for m in at_limit.messages
                                     if m["role"] == "assistant")


def test_agents_get_room_for_a_tool_call_by_default_and_an_explicit_max_turns_holds(tmp_path):
    """With rollout.agent_path and no rollout.max_turns the limit is 8 requests (1 would refuse the request
    that follows any tool call); a max_turns given on the command line, in a YAML file or by RL2's name holds."""
    assert load_config([]).rollout.max_turns == 1
    assert load_config(["rollout.agent_path=agent.py"]).rollout.max_turns == 8
    assert load_config(["rollout.agent_path=agent.py", "rollout.max_turns=1"]).rollout.max_turns == 1
    assert load_config(["rollout.agent_path=agent.py", "rollout.train.max_turns=2"]).rollout.max_turns == 2
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rollout:\n  agent_path: agent.py\n")
    assert load_config([f"config={recipe}"]).rollout.max_turns == 8
    recipe.write_text("rollout:\n  max_turns: 3\n")
    assert load_config([f"config={recipe}", "rollout.agent_path=agent.py"]).rollout.max_turns == 3
