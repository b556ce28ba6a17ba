"""What one agent's requests cannot do to a rank's OpenAI-compatible server (issue 65): token ids outside the
vocabulary are refused before the engine sees them, a request the engine refuses fails alone, an engine that fails fails the requests waiting on it
(none hangs), a non-finite reward is the trajectory's env error, `n` past the request limit generates
nothing, a reply its client never received is not trained, a body past the size limit is refused with 413,
and every endpoint that costs work needs the trajectory's key."""

import asyncio
import json
import threading
import time
import textwrap

import aiohttp
import pytest

from rl2.chat.template import render_chat
from rl2.chat.tool_parsers import get_tool_parser
from rl2.engines import Generation, SamplingParams
from rl2.rollout.rollout_metrics import rollout_metrics
from rl2.rollout.agent_rollout import AgentFile, agent_rollout
from rl2.serve.openai_server import OpenAIServer
from rl2.serve.session import AgentSession
from rl2.testing.tiny import build_tiny_tokenizer
from scripted_engine import ScriptedEngine

pytest.importorskip("openai")

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(template="qwen2.5")


@pytest.fixture(scope="module")
def server(tokenizer):
    server = OpenAIServer(tokenizer, max_request_mb=1)
    yield server
    server.close()


class VocabEngine(ScriptedEngine):
    """A scripted engine that fails as a model's embedding does on an id outside its vocabulary."""

    def generate(self, prompts, params):
        for prompt in prompts:
            bad = [t for t in prompt if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise IndexError(f"index {bad[0]} is out of range")
        return super().generate(prompts, params)


async def post(url: str, body=None, key: str | None = None, data: bytes | None = None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.post(url, json=body if data is None else None, data=data, headers=headers) as response:
            return response.status, await response.json(content_type=None)


def serve(server, engine, tokenizer, episode, count: int = 1, max_requests: int = 4) -> list[AgentSession]:
    """Run `episode(i, key)` for `count` sessions on the server, the engine generating in this thread."""
    sessions = [AgentSession(tokenizer, get_tool_parser("hermes")) for _ in range(count)]
    server.serve_rollout(engine, sessions, episode, SamplingParams(max_new_tokens=16), 0, max_requests, 4096)
    return sessions


def test_token_ids_outside_the_vocabulary_are_refused_before_the_engine(server, tokenizer):
    """`input_ids` at `/s/{key}/generate` and a prompt of ids at `/v1/completions` holding 10**6, -3, a string
    or a bool get 400 naming the id and the vocabulary's size; the engine never sees them and serves the
    next request."""
    vocab, answers = len(tokenizer), []

    async def episode(i: int, key: str) -> None:
        root = server.session_url(key)
        for bad in (10**6, -3, "7", True, 1.5):
            answers.append(await post(f"{root}/generate", {"input_ids": [1, bad]}))
            answers.append(await post(f"{server.base_url}/completions", {"prompt": [bad, 2]}, key))
        answers.append(await post(f"{root}/generate", {"input_ids": [1, 2, 3]}))

    engine = VocabEngine(tokenizer, lambda text: "fine")
    (session,) = serve(server, engine, tokenizer, episode)
    *refused, (status, reply) = answers
    assert status == 200 and reply["text"].startswith("fine") and session.requests_started == 1
    for (code, body), bad in zip(refused, [b for b in (10**6, -3, "7", True, 1.5) for _ in range(2)]):
        message = body["error"]["message"]
        assert code == 400 and repr(bad) in message and str(vocab) in message, message
    assert all(not 10**6 in prompt for call in engine.calls for prompt in call)


def test_an_engine_that_fails_fails_the_requests_waiting_on_it(server, tokenizer):
    """An engine call that raises: the requests it held and those made after get 500 (no agent waits
    forever), and the rollout raises the engine's error."""
    answers = []

    def reply(text: str) -> str:
        if "boom" in text:
            raise RuntimeError("the engine broke")
        return "fine"

    async def episode(i: int, key: str) -> None:
        message = "boom" if i == 0 else "hello"
        for _ in range(2):
            answers.append(await post(f"{server.base_url}/chat/completions",
                                      {"messages": [{"role": "user", "content": message}]}, key))

    with pytest.raises(RuntimeError, match="the engine broke"):
        serve(server, ScriptedEngine(tokenizer, reply), tokenizer, episode, count=2)
    deadline = time.monotonic() + 10
    while len(answers) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    failed = [body["error"] for status, body in answers if status == 500]
    assert len(answers) == 4 and all(error["code"] == "engine_error" for error in failed)
    assert any("the engine broke" in error["message"] for error in failed)  # the rest: 401 once the rollout ended


class RefusingEngine(ScriptedEngine):
    """A scripted engine that refuses, as the hf engine does a request it cannot generate, any prompt saying
    "boom", and generates the others of the same call."""

    def generate(self, prompts, params):
        out = super().generate(prompts, params)
        for i, prompt in enumerate(prompts):
            if "boom" in self.tokenizer.decode(prompt):
                out[i] = Generation.refused(f"request {i}: token id 99 is outside the vocabulary")
        return out


def test_a_request_the_engine_refuses_fails_alone(server, tokenizer):
    """An engine refusing one request of a batch: that request gets 400 with the engine's reason, its
    session goes on, the other sessions' requests of the same engine calls are answered, the rollout
    returns (nothing raises)."""
    answers = {}

    async def episode(i: int, key: str) -> None:
        for turn in range(2):
            message = "boom" if (i, turn) == (0, 0) else f"hello {i} {turn}"
            answers[i, turn] = await post(f"{server.base_url}/chat/completions",
                                          {"messages": [{"role": "user", "content": message}]}, key)

    engine = RefusingEngine(tokenizer, lambda text: "fine")
    serve(server, engine, tokenizer, episode, count=3)
    status, body = answers.pop((0, 0))
    assert status == 400 and "refused by the engine: request" in body["error"]["message"], body
    assert len(answers) == 5 and all(code == 200 for code, _ in answers.values()), answers


def test_a_non_finite_reward_is_the_trajectorys_env_error(server, tokenizer, tmp_path):
    """`run` returning NaN or inf: the trajectory has no reward and an env error naming the value (counted in
    env_errors); posting NaN to /rl/reward is refused with 400."""
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent('''
        import aiohttp


        async def run(row, client, base_url, api_key):
            await client.chat.completions.create(model="rl2", messages=row["messages"])
            if row["messages"][0]["content"] == "posts":
                async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}) as http:
                    async with http.post(base_url.removesuffix("/v1") + "/rl/reward", data=b'{"reward": NaN}') as answer:
                        message = (await answer.json())["error"]["message"]
                        assert answer.status == 400 and "finite" in message, message
                return 0.5
            return float(row["messages"][0]["content"])
    '''))
    rows = []
    for question in ("nan", "inf", "-inf", "posts"):
        messages = [{"role": "user", "content": question}]
        ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
        rows.append({"prompt_ids": ids, "messages": messages, "answer": None})
    trajectories = agent_rollout(server, ScriptedEngine(tokenizer, lambda text: "fine"), AgentFile(str(path)),
                                 tokenizer, get_tool_parser("hermes"), rows, 1, SamplingParams(max_new_tokens=16), 4)
    *bad, posted = trajectories
    for trajectory, value in zip(bad, ("nan", "inf", "-inf")):
        assert trajectory.reward is None and len(trajectory.errors) == 1
        assert f"reward of {value}" in trajectory.errors[0] and "finite" in trajectory.errors[0]
    assert posted.reward == 0.5 and not posted.errors  # the refused post: run went on and returned its own
    assert rollout_metrics(trajectories)["env_errors"] == 3.0


def test_n_past_the_request_limit_generates_nothing(server, tokenizer):
    """`n=5` with 3 requests left is refused whole: nothing generated, nothing kept; `n=3` then fits."""
    answers = []

    async def episode(i: int, key: str) -> None:
        root = server.base_url
        answers.append(await post(f"{root}/chat/completions", {"messages": HELLO}, key))
        answers.append(await post(f"{root}/chat/completions", {"messages": HELLO, "n": 5}, key))
        answers.append(await post(f"{root}/completions", {"prompt": "hi", "n": 5}, key))
        answers.append(await post(f"{root}/chat/completions", {"messages": HELLO, "n": 3}, key))

    engine = ScriptedEngine(tokenizer, lambda text: "fine")
    (session,) = serve(server, engine, tokenizer, episode)
    statuses = [status for status, _ in answers]
    assert statuses == [200, 400, 400, 200], answers
    assert "3 left, 5 asked" in answers[1][1]["error"]["message"]
    assert session.requests == 4 and len(session.sequences) == 4 and sum(len(c) for c in engine.calls) == 4


def test_a_reply_the_client_never_read_is_not_trained(server, tokenizer):
    """A client that disconnects while its request is generated (a real HTTP client giving up): the
    generation is dropped from the trajectory; the trajectory's next request is kept as usual."""
    release, started = threading.Event(), threading.Event()
    events = []

    def reply(text: str) -> str:
        if "slow" in text:
            started.set()
            release.wait(10)
        return "fine"

    async def episode(i: int, key: str) -> None:
        timeout = aiohttp.ClientTimeout(total=0.5)
        async with aiohttp.ClientSession(timeout=timeout, headers={"Authorization": f"Bearer {key}"}) as http:
            for stream in (False, True):
                try:
                    await http.post(f"{server.base_url}/chat/completions",
                                    json={"messages": [{"role": "user", "content": "slow"}], "stream": stream})
                except asyncio.TimeoutError:
                    events.append("gave up")
        await asyncio.sleep(0.3)  # the handler sees the disconnect
        release.set()
        await asyncio.sleep(0.3)
        events.append(await post(f"{server.base_url}/chat/completions", {"messages": HELLO}, key))

    (session,) = serve(server, ScriptedEngine(tokenizer, reply), tokenizer, episode, max_requests=8)
    assert events[:2] == ["gave up", "gave up"] and events[2][0] == 200
    assert session.requests == 1 and len(session.sequences) == 1
    assert session.sequences[0].messages[0]["content"] == "hello"


def test_a_body_past_the_limit_is_refused_and_endpoints_need_the_key(server, tokenizer):
    """A body past `max_request_mb` (1 MB here) gets 413 in OpenAI's shape; `/tokenize` and
    `/parse_function_call` need a trajectory's key (401 without), `/v1/models` stays open; a large body
    under the limit is parsed off the event loop while other requests are answered."""
    answers = {}

    async def episode(i: int, key: str) -> None:
        root = server.base_url.removesuffix("/v1")
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 2 * 2**20}]}).encode()
        answers["big"] = await post(f"{server.base_url}/chat/completions", key=key, data=big)
        answers["tokenize"] = await post(f"{root}/tokenize", {"prompt": "hi"})
        answers["tokenize keyed"] = await post(f"{root}/tokenize", {"prompt": "hi"}, key)
        answers["parse"] = await post(f"{root}/s/rl2-unknown/parse_function_call",
                                      {"text": "hi", "tool_call_parser": "qwen25"})
        answers["parse keyed"] = await post(f"{server.session_url(key)}/parse_function_call",
                                            {"text": "hi", "tool_call_parser": "qwen25"})
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{server.base_url}/models") as response:
                answers["models"] = response.status
        half = json.dumps({"prompt": " ".join(["word"] * 150_000)}).encode()  # ~0.9 MB: under the limit
        answers["half"], answers["models during"] = await asyncio.gather(
            post(f"{root}/tokenize", key=key, data=half), post(f"{root}/tokenize", {"prompt": "hi"}, key))

    serve(server, ScriptedEngine(tokenizer, lambda text: "fine"), tokenizer, episode)
    status, body = answers["big"]
    assert status == 413 and body["error"]["code"] == "request_too_large" and "1 MB" in body["error"]["message"]
    assert answers["tokenize"][0] == 401 and answers["parse"][0] == 401 and answers["models"] == 200
    assert answers["tokenize keyed"][0] == 200 and answers["parse keyed"] == (200, {"normal_text": "hi", "calls": []})
    assert answers["half"][0] == 200 and answers["half"][1]["count"] >= 150_000
    assert answers["models during"][0] == 200


def test_drop_undoes_what_a_request_kept(tokenizer):
    """`AgentSession.drop`: a request's kept generations (a continuation of a sequence, a new sequence) are
    undone, leaving the session as it was before the request."""
    from rl2.engines import Generation

    session = AgentSession(tokenizer, get_tool_parser("hermes"))
    fine = tokenizer("fine", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def keep(messages, kept=None):
        plan = session.plan(messages, None)
        message, _ = session.record(plan, Generation(fine, [-0.5] * len(fine), "stop"), [0] * len(fine),
                                    {tokenizer.eos_token_id}, kept)
        return message

    reply = keep(HELLO)
    before = (list(session.sequences[0].token_ids), session.sequences[0].messages, session.requests,
              session.reused_tokens, session.rendered_tokens)
    kept = []
    keep(HELLO + [reply, {"role": "user", "content": "again"}], kept)  # continues the sequence
    keep([{"role": "user", "content": "other"}], kept)  # a sequence of its own
    assert len(session.sequences) == 2 and len(session.sequences[0].token_ids) > len(before[0])
    session.drop(kept)
    sequence = session.sequences[0]
    assert len(session.sequences) == 1 and kept == []
    assert (sequence.token_ids, sequence.messages, session.requests, session.reused_tokens,
            session.rendered_tokens) == before
    assert len(sequence.action_mask) == len(sequence.logprobs) == len(sequence.versions) == len(before[0])
