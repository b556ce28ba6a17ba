"""Random and adversarial requests on every endpoint of the agent server (issue 65), over real loopback HTTP:
each is answered 2xx, or 4xx in OpenAI's error shape; none is a 500, none hangs, and the server serves a
normal request after. Seeded (`RL2_FUZZ_SEED` picks another seed) and bounded in time."""

import asyncio
import json
import os
import random
import time

import aiohttp
import pytest

from rl2.chat.tool_parsers import get_tool_parser
from rl2.engines import SamplingParams
from rl2.serve.openai_server import OpenAIServer
from rl2.serve.session import AgentSession
from rl2.testing.tiny import build_tiny_tokenizer
from scripted_engine import ScriptedEngine

SEED = int(os.environ.get("RL2_FUZZ_SEED", "65"))
SECONDS = 4.0  # of fuzzing, in all
SESSIONS = 3  # fuzzing at once, each with its own key
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"box": "red"}}\n</tool_call>'
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"box": {"type": "string"}}, "required": ["box"]}}}

# Method, path ({key}: the session's own key in the path), and whether it takes a JSON body.
ENDPOINTS = [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize"),
    ("POST", "/rl/reward"), ("POST", "/v1/responses"), ("POST", "/s/{key}/generate"),
    ("POST", "/s/{key}/v1/chat/completions"), ("POST", "/s/{key}/v1/completions"), ("GET", "/s/{key}/v1/models"),
    ("GET", "/s/{key}/list_workers"), ("POST", "/s/{key}/parse_function_call"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(template="qwen2.5")


def random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2**31, -2**63, 2**64, 10**30, rng.randint(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.5, -1e308, 1e-320, 3.0, rng.uniform(-10, 10)])
    if kind in (4, 5):
        return rng.choice(["", "hi", "user", "assistant", "tool", "\x00", "\ud7ff\u202e", "<|im_end|>", CALL,
                           "{", "x" * rng.randrange(200)])
    if kind == 6:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["role", "content", "messages", "prompt", "n", "tools", "type", "function", "text", "reward", "input_ids",
            "stream", "max_tokens", "sampling_params", "tool_calls", "arguments", "name", rng.choice(["", "z" * 9])]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def valid_body(rng: random.Random, path: str, vocab: int) -> dict:
    """A body each endpoint accepts, to be mutated."""
    messages = [{"role": "user", "content": rng.choice(["hello", "use a tool", "what is on the red box?"])}]
    if rng.random() < 0.3:
        messages += [{"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function", "function": {
            "name": "lookup", "arguments": json.dumps({"box": "red"})}}]}, {"role": "tool", "tool_call_id": "c0",
                                                                               "content": "3"}]
    if path.endswith("chat/completions"):
        body = {"model": "rl2", "messages": messages, "stream": rng.random() < 0.3}
        if rng.random() < 0.5:
            body["tools"] = [LOOKUP]
        return body
    if path.endswith("completions"):
        return {"model": "rl2", "prompt": rng.choice(["hello", [rng.randrange(vocab) for _ in range(5)]])}
    if path == "/tokenize":
        return rng.choice([{"messages": messages}, {"prompt": "hello"}])
    if path == "/rl/reward":
        return {"reward": rng.uniform(-1, 1)}
    if path.endswith("generate"):
        return rng.choice([{"input_ids": [rng.randrange(vocab) for _ in range(4)], "sampling_params": {"max_new_tokens": 4}},
                           {"text": "hello", "return_logprob": True}])
    if path.endswith("parse_function_call"):
        return {"text": CALL, "tools": [LOOKUP], "tool_call_parser": "qwen25"}
    return {}


ADVERSARIAL = [
    ("n", [0, -1, 1, 2, 3, 10**18, 2**63, True, 1.5, "2", None, []]),
    ("max_tokens", [0, -5, 1, 10**30, 2**63, False, "9", 1e308, None]),
    ("max_completion_tokens", [0, 1, 10**12, -1, {}]),
    ("stream", [True, False, "yes", 1, None, {}]),
    ("stream_options", [{"include_usage": True}, {"include_usage": "x"}, [], "x", 3, None]),
    ("logprobs", [True, 5, "x", None]), ("return_token_ids", [True, 1, [], None]),
    ("messages", [[], {}, "hi", [None], [{}], [{"role": 5}], [{"role": "user", "content": 7}],
                  [{"role": "user", "content": [{"type": "image_url"}]}], [{"role": "user", "content": [{"type": "text"}]}],
                  [{"role": "assistant", "tool_calls": "x"}], [{"role": "assistant", "tool_calls": [{"function": 3}]}],
                  [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
                  [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "1" * 5000}}]}],
                  [{"role": "nobody", "content": "x"}], [{"role": "tool", "content": "x"}]]),
    ("tools", [[], {}, "x", [None], [{"type": "retrieval"}], [{"function": "f"}], [{"function": {}}],
               [{"type": "function", "function": {"name": 3, "parameters": []}}], None]),
    ("tool_choice", ["required", "none", {"type": "function"}, 3, None]),
    ("prompt", [[], [[]], [[1, 2]], [-1], [10**9], [2**64], [True], ["a", "b"], [1.0], {}, 3, "", None]),
    ("input_ids", [[], [-1], [10**9], ["1"], [None], "abc", {}, [[1]], None]),
    ("sampling_params", [[], "x", 3, {"max_new_tokens": -1}, {"max_new_tokens": 10**30}, {"temperature": "hot"},
                         {"skip_special_tokens": "no"}, {"max_new_tokens": True}, None]),
    ("text", [3, [], None, "", CALL * 50]),
    ("tool_call_parser", ["qwen25", "nope", 3, [], {}, None, "mistral", "llama3"]),
    ("reward", [0.5, True, "1", None, [], {}, 10**400, -0.0]),
    ("add_generation_prompt", [False, "x", None]),
    ("model", [None, 3, [], "x" * 1000]),
    ("temperature", [0, -1, "x", 1e308]),
]

# Bodies sent as raw bytes: not JSON, not UTF-8, huge numbers, deep nesting, non-finite numbers.
RAW = [b"", b"{", b"null", b"[]", b"3", b'"x"', b"\xff\xfe", b"{\"messages\": [" + b"[" * 50000,
       b"[" * 100000, b'{"a":' * 20000 + b"1" + b"}" * 20000, b'{"n": ' + b"9" * 5000 + b"}",
       b'{"reward": ' + b"9" * 5000 + b"}", b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": -Infinity}',
       b'{"reward": 1e999}', b'{"max_tokens": 1e999, "messages": [{"role": "user", "content": "hi"}]}',
       b'{"prompt": [1, 2, 1e999]}', b'{"input_ids": [NaN]}', b'{"messages": "' + b"x" * 300_000 + b'"}',
       b'{"prompt": "' + b"ab " * 30_000 + b'"}']


def request(rng: random.Random, key: str, vocab: int) -> tuple[str, str, dict, bytes | None]:
    """A random request: method, path, headers, body."""
    method, path = rng.choice(ENDPOINTS)
    path_key = key if rng.random() < 0.85 else rng.choice(["rl2-nope", "x", "rl2-" + "0" * 24, "a" * 300])
    path = path.replace("{key}", path_key)
    headers = {"Authorization": f"Bearer {key}"}
    roll = rng.random()
    if roll < 0.08:
        headers = {}
    elif roll < 0.15:
        headers = {"Authorization": rng.choice(["Bearer ", "Bearer rl2-0000", "Basic abc", key, "Bearer " + key + "x"])}
    if method == "GET":
        return method, path, headers, None
    kind = rng.random()
    if kind < 0.2:
        body = json.dumps(random_json(rng)).encode()
    elif kind < 0.35:
        body = rng.choice(RAW)
    else:
        content = valid_body(rng, path, vocab)
        for _ in range(rng.randrange(3)):
            name, values = rng.choice(ADVERSARIAL)
            content[name] = rng.choice(values)
        body = json.dumps(content).encode()
    return method, path, headers, body


def problem(status: int, content_type: str, raw: bytes, streamed: bool) -> str | None:
    """What is wrong with an answer, or None."""
    if status >= 500 or not (200 <= status < 300 or 400 <= status < 500):
        return f"status {status}"
    if 200 <= status < 300:
        if streamed:
            return None if raw.rstrip().endswith(b"data: [DONE]") else "a stream that did not end with [DONE]"
        try:
            json.loads(raw)
        except ValueError:
            return "a 2xx whose body is not JSON"
        return None
    try:
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str) and "code" in error
        assert "param" in error
    except (ValueError, KeyError, TypeError, AssertionError):
        return f"a {status} not in OpenAI's error shape ({content_type})"
    return None


def test_random_and_adversarial_requests_get_2xx_or_an_openai_4xx_and_the_server_goes_on(tokenizer):
    server = OpenAIServer(tokenizer, max_request_mb=0.25)  # a 300 kB body is refused, a 90 kB one parsed off the loop
    vocab, root = len(tokenizer), f"http://127.0.0.1:{server.port}"
    found, sent = [], []
    deadline = time.monotonic() + SECONDS

    async def episode(i: int, key: str) -> None:
        rng = random.Random(SEED * 100 + i)
        timeout = aiohttp.ClientTimeout(total=20)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while time.monotonic() < deadline:
                method, path, headers, body = request(rng, key, vocab)
                streamed = False
                if body is not None:
                    headers = headers | {"Content-Type": "application/json"}
                try:
                    async with http.request(method, root + path, data=body, headers=headers) as answer:
                        raw = await answer.read()
                        streamed = answer.content_type == "text/event-stream"
                        why = problem(answer.status, answer.content_type, raw, streamed)
                except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                    why = f"{type(error).__name__}: {error}"
                    raw = b""
                sent.append(path)
                if why:
                    found.append(f"{method} {path} {(body or b'')[:300]!r}: {why}: {raw[:300]!r}")

    engine = ScriptedEngine(tokenizer, lambda text: CALL if "tool" in text[-40:] else "fine")
    sessions = [AgentSession(tokenizer, get_tool_parser("hermes")) for _ in range(SESSIONS)]
    try:
        start = time.monotonic()
        server.serve_rollout(engine, sessions, episode, SamplingParams(max_new_tokens=8), 0, 60, 4096,
                             served_requests=20)
        elapsed = time.monotonic() - start
        assert not found, f"{len(found)} of {len(sent)} answers were wrong (seed {SEED}):\n" + "\n".join(found[:20])
        assert len(sent) >= 50 and elapsed < SECONDS + 30, (len(sent), elapsed)

        # after the fuzz, a normal request of a new rollout is served
        answers = []

        async def normal(i: int, key: str) -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
                async with http.post(f"{root}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                     json={"model": "rl2", "messages": [{"role": "user", "content": "hello"}]}) as answer:
                    answers.append((answer.status, await answer.json()))

        (session,) = [AgentSession(tokenizer, get_tool_parser("hermes"))]
        server.serve_rollout(ScriptedEngine(tokenizer, lambda text: "fine"), [session], normal,
                             SamplingParams(max_new_tokens=8), 0, 4, 4096)
        ((status, reply),) = answers
        assert status == 200 and reply["choices"][0]["message"]["content"] == "fine", reply
        assert session.requests_started == 1 and len(session.sequences) == 1
    finally:
        server.close()
