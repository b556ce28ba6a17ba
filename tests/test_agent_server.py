"""Agents over the OpenAI API: the real `openai` client against rl2's per-rank server, each request's tokens
recorded exactly as sampled (also where re-encoding the text would give other ids), sessions kept apart,
unknown keys refused, and an agent that fails scoring nothing."""

import json
import textwrap
import urllib.error
import urllib.request

import pytest

from rl2.chat.template import render_chat
from rl2.chat.tool_parsers import get_tool_parser
from rl2.engines import Generation, SamplingParams
from rl2.rollout.env import Env
from rl2.rollout.rollout_metrics import rollout_metrics
from rl2.rollout.agent_rollout import AgentFile, agent_rollout, score_unscored
from rl2.serve.openai_server import OpenAIServer
from rl2.testing.tiny import build_tiny_tokenizer
from scripted_engine import ScriptedEngine

openai = pytest.importorskip("openai")

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Read the code written on a box.",
                                           "parameters": {"type": "object", "properties": {"box": {"type": "string"}},
                                                          "required": ["box"]}}}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"box": "red"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(template="qwen2.5")


@pytest.fixture(scope="module")
def server(tokenizer):
    server = OpenAIServer(tokenizer)
    yield server
    server.close()


def rows(tokenizer, questions: list[str]) -> list[dict]:
    out = []
    for question in questions:
        messages = [{"role": "user", "content": question}]
        ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
        out.append({"prompt_ids": ids, "messages": messages, "answer": "3"})
    return out


def agent_file(tmp_path, source: str) -> AgentFile:
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(source))
    return AgentFile(str(path))


def run_agents(server, engine, tokenizer, agent, questions, responses_per_prompt=1, max_requests=8, merge=True):
    return agent_rollout(server, engine, agent, tokenizer, get_tool_parser("hermes"), rows(tokenizer, questions),
                         responses_per_prompt, SamplingParams(max_new_tokens=256), max_requests, 4096, merge=merge)


def by_tool_results(replies: list[str]):
    """A scripted model: its reply is the one for the number of tool results in the conversation so far."""
    return lambda text: replies[min(text.count("<tool_response>"), len(replies) - 1)]


TOOL_LOOP = '''
    LOOKUP = {lookup}


    async def run(row, client):
        messages = list(row["messages"])
        for _ in range(4):
            reply = await client.chat.completions.create(model="rl2", messages=messages, tools=[LOOKUP])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return float(message.content.endswith(row["answer"]))
            for call in message.tool_calls:
                box = __import__("json").loads(call.function.arguments)["box"]
                messages.append({{"role": "tool", "tool_call_id": call.id, "content": f"the {{box}} box says 3"}})
        return 0.0
'''.format(lookup=repr(LOOKUP))


def test_a_tool_loop_through_the_openai_sdk_is_one_exact_sequence(server, tokenizer, tmp_path):
    """An agent's tool loop (the SDK's parsed `tool_calls`, tool messages back): each request continues the
    last, so the trajectory is one sequence: prompt, the sampled turns, the template's tokens between them."""
    engine = ScriptedEngine(tokenizer, by_tool_results([CALL, "The code is 3"]))
    (trajectory,) = run_agents(server, engine, tokenizer, agent_file(tmp_path, TOOL_LOOP), ["What is the red code?"])
    assert trajectory.reward == 1.0 and not trajectory.errors and trajectory.turns == 2
    assert trajectory.agent_stats["sequences"] == 1 and trajectory.agent_stats["drift_requests"] == 0
    assert trajectory.turn_starts is None
    (first,), (second,) = engine.calls
    generated = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert second[:len(first) + len(generated)] == first + generated  # the sampled call, not a re-rendering
    assert trajectory.token_ids[:len(second)] == second
    text = tokenizer.decode(trajectory.token_ids, skip_special_tokens=False)
    assert "the red box says 3" in text and text.endswith("The code is 3<|im_end|>")
    assert sum(trajectory.action_mask) == len(generated) + len(tokenizer("The code is 3")["input_ids"]) + 1
    assert trajectory.messages[-1] == {"role": "assistant", "content": "The code is 3"}


class CharacterEngine(ScriptedEngine):
    """Samples its replies one character at a time: token ids a model may well draw, which are not what
    encoding the same text gives (`<tool_call>` in pieces, no merges)."""

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        out = []
        for prompt in prompts:
            text = self.reply(self.tokenizer.decode(prompt, skip_special_tokens=False))
            tokens = [i for ch in text for i in self.tokenizer(ch, add_special_tokens=False)["input_ids"]]
            tokens.append(self.tokenizer.eos_token_id)
            out.append(Generation(token_ids=tokens, logprobs=[-0.25] * len(tokens), finish_reason="stop"))
        return out


def test_three_turns_keep_the_sampled_ids_where_re_encoding_differs(server, tokenizer, tmp_path):
    """The model's ids are not the text's encoding: a server that re-encoded earlier assistant turns would
    train on other tokens than were sampled. Every prompt the engine gets is the previous prompt, the
    previous sampled ids and the template's tokens for the tool message; the trajectory is the last one
    and its generation, with exactly the sampled ids in the loss."""
    replies = [CALL, CALL, "The code is 3"]
    assert tokenizer(CALL, add_special_tokens=False)["input_ids"] != [
        i for ch in CALL for i in tokenizer(ch, add_special_tokens=False)["input_ids"]]
    engine = CharacterEngine(tokenizer, by_tool_results(replies))
    (trajectory,) = run_agents(server, engine, tokenizer, agent_file(tmp_path, TOOL_LOOP), ["What is the red code?"])
    assert trajectory.turns == 3 and trajectory.reward == 1.0 and trajectory.agent_stats["sequences"] == 1
    prompts = [call[0] for call in engine.calls]
    sampled = [[i for ch in reply for i in tokenizer(ch, add_special_tokens=False)["input_ids"]] + [tokenizer.eos_token_id]
               for reply in replies]
    for k in range(2):
        assert prompts[k + 1][:len(prompts[k]) + len(sampled[k])] == prompts[k] + sampled[k]
    assert trajectory.token_ids == prompts[2] + sampled[2]
    kept = [t for t, m in zip(trajectory.token_ids, trajectory.action_mask) if m]
    assert kept == sampled[0] + sampled[1] + sampled[2]
    assert trajectory.logprobs.count(-0.25) == len(kept)


def test_the_sdk_features_an_agent_uses(server, tokenizer, tmp_path):
    """Sync and async clients, streaming with usage, n > 1, log-probs, vLLM's return_token_ids, a reward
    posted to /rl/reward and the sampling fields the run overrides counted."""
    engine = ScriptedEngine(tokenizer, lambda text: "The code is 3")
    agent = agent_file(tmp_path, '''
        import httpx
        import openai


        def run(row, client, base_url, api_key):
            sync = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
            messages = row["messages"]
            plain = sync.chat.completions.create(model="rl2", messages=messages, n=2, logprobs=True, temperature=0.3,
                                                 extra_body={"return_token_ids": True})
            assert [c.message.content for c in plain.choices] == ["The code is 3"] * 2
            assert plain.usage.completion_tokens == 2 * len(plain.choices[0].token_ids)
            assert [t.token for t in plain.choices[0].logprobs.content][-1] == "<|im_end|>"
            assert plain.prompt_token_ids and plain.choices[0].finish_reason == "stop"
            chunks = list(sync.chat.completions.create(model="rl2", messages=messages, stream=True,
                                                       stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "The code is 3" and chunks[-1].usage.total_tokens > 0
            assert [m.id for m in sync.models.list().data] == ["rl2-policy"]
            posted = httpx.post(base_url.removesuffix("/v1") + "/rl/reward", json={"reward": 0.5},
                                headers={"Authorization": f"Bearer {api_key}"})
            assert posted.status_code == 200
    ''')
    (trajectory,) = run_agents(server, engine, tokenizer, agent, ["What is the red code?"])
    assert not trajectory.errors and trajectory.reward == 0.5
    # two choices of one prompt and a third request of it: three sequences, none re-encoded
    assert trajectory.turns == 3 and trajectory.agent_stats["sequences"] == 3 and trajectory.turn_starts is not None
    assert trajectory.agent_stats["ignored_fields"] == {"temperature": 1}


def test_sessions_never_mix_and_unknown_keys_are_refused(server, tokenizer, tmp_path):
    """Concurrent trajectories each see only their own conversation; a key the server did not give out (or
    one of a rollout that ended) is answered 401 in OpenAI's error shape."""
    engine = ScriptedEngine(tokenizer, lambda text: "echo " + text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0])
    keys = tmp_path / "keys.txt"
    agent = agent_file(tmp_path, f'''
        async def run(row, client, api_key):
            with open({str(keys)!r}, "a") as keys:
                keys.write(api_key + "\\n")
            messages = list(row["messages"])
            for turn in range(3):
                reply = await client.chat.completions.create(model="rl2", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {{"role": "user", "content": f"{{row['messages'][0]['content']}} again {{turn}}"}}]
            return 1.0
    ''')
    questions = [f"question {i}" for i in range(6)]
    trajectories = run_agents(server, engine, tokenizer, agent, questions, responses_per_prompt=2)
    assert len(trajectories) == 12
    for i, trajectory in enumerate(trajectories):
        text = tokenizer.decode(trajectory.token_ids, skip_special_tokens=False)
        own = f"question {i // 2}"
        assert all(f"question {j}" not in text for j in range(6) if f"question {j}" != own), text
        assert text.count("echo " + own) == 3 and trajectory.agent_stats["sequences"] == 1
    ended = keys.read_text().split()
    assert len(set(ended)) == 12
    for key in ("rl2-not-a-key", ended[0], ended[-1]):  # never given out; given to a rollout that ended
        request = urllib.request.Request(server.base_url + "/chat/completions", method="POST",
                                         data=json.dumps({"model": "rl2", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401, key
        assert json.loads(refused.value.read())["error"]["code"] == "invalid_api_key"


def test_a_failing_agent_scores_nothing_and_says_why(server, tokenizer, tmp_path):
    """`run` raising or returning no number: no reward, the error kept on the trajectory, the others scored; a
    run that made no request still has its prompt (its group keeps shape). One that raises at the request limit
    is not a failure: it ends there, to be scored as it stands (`score_unscored`)."""
    engine = ScriptedEngine(tokenizer, lambda text: "fine")
    agent = agent_file(tmp_path, '''
        async def run(row, client):
            kind = row["messages"][0]["content"]
            if kind == "raise":
                raise RuntimeError("the agent broke")
            if kind == "text":
                return "good"
            for _ in range(3 if kind == "greedy" else 1):
                await client.chat.completions.create(model="rl2", messages=row["messages"])
            return {"reward": 1.0, "note": kind}
    ''')
    raised, text, greedy, fine = run_agents(server, engine, tokenizer, agent, ["raise", "text", "greedy", "fine"],
                                            max_requests=2)
    assert raised.reward is None and "run raised" in raised.errors[0] and "RuntimeError: the agent broke" in raised.errors[0]
    assert raised.token_ids == rows(tokenizer, ["raise"])[0]["prompt_ids"] and raised.excluded
    assert text.reward is None and "returned str, not a number" in text.errors[0]
    assert greedy.reward is None and greedy.errors == [] and greedy.agent_stats["at_request_limit"]
    assert fine.reward == 1.0 and not fine.errors


NEVER_ANSWERS = '''
    import httpx
    import openai

    LOOKUP = {lookup}


    async def run(row, client, base_url, api_key):
        kind = row["messages"][0]["content"]
        if kind == "posts":
            async with httpx.AsyncClient() as http:
                await http.post(base_url.removesuffix("/v1") + "/rl/reward", json={{"reward": -0.5}},
                                headers={{"Authorization": f"Bearer {{api_key}}"}})
        messages = list(row["messages"])
        while True:  # a model that only ever calls its tool: the request limit ends the loop
            try:
                reply = await client.chat.completions.create(model="rl2", messages=messages, tools=[LOOKUP])
            except openai.BadRequestError:
                if kind == "catches":
                    return 0.25
                raise
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                messages.append({{"role": "tool", "tool_call_id": call.id, "content": "nothing yet"}})
'''.format(lookup=repr(LOOKUP))


def test_an_agent_at_its_request_limit_is_scored_as_it_stands(server, tokenizer, tmp_path):
    """rollout.max_turns bounds an agent's requests: past it the server answers 400. A run that catches it and
    returns a reward (or posted one) is scored with it; a run that raises is no failure: the env file's
    reward_fn scores its conversation as it stands (-1 here: it never answered), and without an env file it is
    an env error that says how to score it."""
    engine = ScriptedEngine(tokenizer, lambda text: CALL)
    agent = agent_file(tmp_path, NEVER_ANSWERS)
    scorer = tmp_path / "reward.py"
    scorer.write_text("def reward_fn(messages, answer):\n    return -1.0 if messages[-1].get('tool_calls') else 1.0\n")
    with Env(str(scorer), workers=0) as env:
        raises, catches, posts = run_agents(server, engine, tokenizer, agent, ["raises", "catches", "posts"],
                                            max_requests=3)
        assert [t.turns for t in (raises, catches, posts)] == [3, 3, 3]
        assert [t.agent_stats["at_request_limit"] for t in (raises, catches, posts)] == [True] * 3
        assert (raises.reward, catches.reward, posts.reward) == (None, 0.25, -0.5)
        score_unscored(env, [raises, catches, posts])
    assert (raises.reward, catches.reward, posts.reward) == (-1.0, 0.25, -0.5)
    assert raises.errors == [] and raises.messages[-1]["tool_calls"] and not raises.excluded
    metrics = rollout_metrics([raises, catches, posts])
    assert metrics["env_errors"] == 0.0 and metrics["excluded"] == 0.0 and metrics["agent/at_request_limit"] == 1.0

    (alone,) = run_agents(server, engine, tokenizer, agent, ["raises"], max_requests=2)
    score_unscored(None, [alone])
    assert alone.reward is None and alone.turns == 2 and len(alone.errors) == 1
    assert "request limit (2 requests, rollout.max_turns)" in alone.errors[0] and "reward_fn" in alone.errors[0]


def test_raw_completions_continue_by_token_ids_and_each_mode_splits_requests(server, tokenizer, tmp_path):
    """`/v1/completions` with token ids (vLLM's `return_token_ids` sent back): a prompt that starts with an earlier
    sequence continues it exactly; `/tokenize` renders as the template does. With agent_sequences=each every
    request is its own sequence, its prompt still the sampled ids."""
    engine = ScriptedEngine(tokenizer, lambda text: "fine")
    agent = agent_file(tmp_path, '''
        import httpx


        async def run(row, client, base_url, api_key):
            root = base_url.removesuffix("/v1")
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}) as http:
                tokens = (await http.post(root + "/tokenize", json={"messages": row["messages"]})).json()
                first = await client.completions.create(model="rl2", prompt=tokens["tokens"],
                                                        extra_body={"return_token_ids": True})
                ids = first.prompt_token_ids + first.choices[0].token_ids
                again = await client.completions.create(model="rl2", prompt=ids + tokens["tokens"][-3:])
            assert first.choices[0].text == "fine<|im_end|>" and again.choices[0].text.startswith("fine")
            return 1.0
    ''')
    (trajectory,) = run_agents(server, engine, tokenizer, agent, ["hello"])
    assert not trajectory.errors and trajectory.agent_stats["sequences"] == 1 and trajectory.turns == 2
    prompt = rows(tokenizer, ["hello"])[0]["prompt_ids"]
    fine = tokenizer("fine", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert trajectory.token_ids == prompt + fine + prompt[-3:] + fine
    assert trajectory.agent_stats["reused_tokens"] == len(prompt) + len(fine)

    engine = ScriptedEngine(tokenizer, by_tool_results([CALL, "The code is 3"]))
    (each,) = run_agents(server, engine, tokenizer, agent_file(tmp_path, TOOL_LOOP), ["What is the red code?"],
                         merge=False)
    assert each.reward == 1.0 and each.agent_stats["sequences"] == 2 and each.agent_stats["drift_requests"] == 0
    first, second = each.turn_starts
    assert each.token_ids[second:] == engine.calls[1][0] + tokenizer("The code is 3")["input_ids"] + [tokenizer.eos_token_id]
    assert each.token_ids[second:second + second] == each.token_ids[:second]  # the first sequence, as sampled


def test_a_first_request_for_the_rows_prompt_takes_the_rows_ids(tokenizer):
    """A session knows its dataset row: a first request for exactly the row's messages and tools is given the
    row's prompt ids (the template's rendering, made once by the dataset), any other request is rendered."""
    from rl2.serve.session import AgentSession

    messages = [{"role": "user", "content": "What is on the red box?"}]
    rendered = tokenizer(render_chat(messages, tokenizer, True, [LOOKUP]), add_special_tokens=False)["input_ids"]
    marked = [7, 7, 7]  # ids the template would never give: where they come back, the row's were taken
    row = {"messages": messages, "tools": [LOOKUP], "prompt_ids": marked, "answer": "3"}
    assert AgentSession(tokenizer, get_tool_parser("hermes"), row=row).plan(messages, [LOOKUP]).prompt_ids == marked
    assert AgentSession(tokenizer, get_tool_parser("hermes")).plan(messages, [LOOKUP]).prompt_ids == rendered
    other = [{"role": "user", "content": "What is on the blue box?"}]
    session = AgentSession(tokenizer, get_tool_parser("hermes"), row=row)
    assert session.plan(messages, None).prompt_ids != marked and session.plan(other, [LOOKUP]).prompt_ids != marked
