"""The LLM judge (`rl2.tools.judge`, `envs/judge_reward.py`) against real HTTP endpoints on 127.0.0.1: a stand-in
OpenAI chat-completions server that checks each request and answers a score, and rl2's own OpenAI server over a
scripted engine. Scores are parsed and normalised, requests bounded, retried and cached; every failure raises an
error naming the endpoint, and through the env file it is an env error, never a reward of 0."""

import asyncio
import os
import socket
import threading
import time

import pytest
from aiohttp import web

from rl2.rollout.env import Env, EnvError
from rl2.tools.judge import Judge, JudgeError, parse_score

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_FILE = os.path.join(REPO, "envs", "judge_reward.py")
MODEL = "judge-model"
RUBRIC = "Rate the answer.\nQ: {question}\nReference: {answer}\nA: {response}\nScore 0-10 as <score>N</score>."
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "It is 4."}]


class JudgeServer:
    """A stand-in OpenAI chat-completions endpoint on 127.0.0.1 (port 0), on an event loop in its own thread.
    `reply(prompt)` is its reply to a request whose last message is `prompt`; the first `failures` requests get
    HTTP `status` instead. It records each request and the most requests it held at once."""

    def __init__(self, reply=lambda prompt: "Looks right. <score>7</score>", failures: int = 0, status: int = 503,
                 delay: float = 0.0):
        self.reply, self.failures, self.status, self.delay = reply, failures, status, delay
        self.requests: list[dict] = []
        self.active = self.most_active = 0
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
        self.base_url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"
        started.set()
        self.loop.run_forever()

    async def chat_completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"body": body, "authorization": request.headers.get("Authorization")})
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.active -= 1
        if len(self.requests) <= self.failures:
            return web.json_response({"error": {"message": "overloaded"}}, status=self.status)
        content = self.reply(body["messages"][-1]["content"])
        return web.json_response({"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": content}}]})

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def serve():
    servers = []

    def start(**kwargs) -> JudgeServer:
        servers.append(JudgeServer(**kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def judge_at(server: JudgeServer, **kwargs) -> Judge:
    return Judge(server.base_url, MODEL, **{"rubric": RUBRIC, "backoff": 0.01, **kwargs})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# scores


def test_a_score_is_parsed_and_normalised_from_a_checked_request(serve):
    server = serve(reply=lambda prompt: "Right, if terse: 7/10. <score>7</score>")
    judge = judge_at(server, api_key="sk-test", system_prompt="You are a strict grader.")
    assert asyncio.run(judge.score("What is 2+2?", "It is 4.", "4")) == pytest.approx(0.7)
    (request,) = server.requests
    body = request["body"]
    assert body["model"] == MODEL and body["temperature"] == 0 and body["max_tokens"] == 1024
    assert body["messages"] == [
        {"role": "system", "content": "You are a strict grader."},
        {"role": "user", "content": "Rate the answer.\nQ: What is 2+2?\nReference: 4\nA: It is 4.\n"
                                    "Score 0-10 as <score>N</score>."}]
    assert request["authorization"] == "Bearer sk-test" and "sk-test" not in repr(judge)
    assert judge.counts() == {"calls": 1, "cache_hits": 0, "retries": 0, "failures": 0}
    # From sync code, another scale; a non-string answer goes in as JSON, braces in the rubric stay.
    other = judge_at(server, max_score=20, rubric='{"q": "{question}", "a": {answer}} {response}')
    assert other.score_sync("q", "r", {"gold": [1, 2]}) == pytest.approx(0.35)
    assert server.requests[-1]["body"]["messages"][-1]["content"] == '{"q": "q", "a": {"gold": [1, 2]}} r'


def test_parse_score_reads_the_tag_else_the_last_number():
    assert parse_score("Good. <score> 8 </score> (out of 10, 9 was close)") == 8.0  # the tag wins
    assert parse_score("<score>3</score> then <score>6.5</score>") == 6.5
    assert parse_score("Score: 8/10") == 8.0 and parse_score("I give it 3 out of 10.") == 3.0
    assert parse_score("Step 1 is fine; overall 4.5") == 4.5
    for reply in ("No verdict.", "<score>high</score>"):
        with pytest.raises(ValueError):
            parse_score(reply)


def test_a_reply_without_a_usable_score_raises_naming_the_endpoint(serve):
    replies = iter(["I cannot decide.", "<score>12</score>", "<score>nine</score>", "I cannot decide."])
    server = serve(reply=lambda prompt: next(replies))
    judge = judge_at(server)
    url = f"{server.base_url}/chat/completions"
    with pytest.raises(JudgeError, match=f"judge at {url} \\(model 'judge-model'\\) gave no score.*I cannot decide"):
        judge.score_sync("q", "r")
    with pytest.raises(JudgeError, match="scored 12, outside 0..10"):
        judge.score_sync("q", "r2")
    with pytest.raises(JudgeError, match="<score> holds no number: 'nine'"):
        judge.score_sync("q", "r3")
    with pytest.raises(JudgeError, match="gave no score"):  # a failure is not cached: asked again
        judge.score_sync("q", "r")
    assert len(server.requests) == 4
    assert judge.counts() == {"calls": 4, "cache_hits": 0, "retries": 0, "failures": 4}


# ----------------------------------------------------------------------------------------------
# requests


def test_at_most_concurrency_requests_are_in_flight(serve):
    server = serve(delay=0.15)
    judge = judge_at(server, concurrency=3)

    async def many():
        return await asyncio.gather(*(judge.score("q", f"response {i}") for i in range(9)))

    start = time.perf_counter()
    assert asyncio.run(many()) == [pytest.approx(0.7)] * 9
    assert server.most_active == 3 and len(server.requests) == 9
    assert time.perf_counter() - start >= 3 * 0.15  # three waves


def test_503_and_429_are_retried_then_succeed(serve):
    for status in (503, 429):
        server = serve(failures=2, status=status)
        judge = judge_at(server)
        assert judge.score_sync("q", "r") == pytest.approx(0.7)
        assert len(server.requests) == 3
        assert judge.faults.counts() == {"judge_retries": 2}
        assert judge.counts() == {"calls": 1, "cache_hits": 0, "retries": 2, "failures": 0}


def test_a_persistent_failure_raises_naming_the_endpoint(serve, monkeypatch):
    server = serve(failures=100, status=500)
    judge = judge_at(server, retries=2)
    with pytest.raises(JudgeError) as error:
        judge.score_sync("q", "r")
    assert str(error.value).startswith(f"judge at {server.base_url}/chat/completions failed with HTTP 500: ")
    assert "overloaded" in str(error.value) and str(error.value).endswith("(gave up after 3 attempts)")
    assert len(server.requests) == 3 and judge.counts()["failures"] == 1

    monkeypatch.delenv("JUDGE_API_KEY", raising=False)
    refused = serve(failures=100, status=401)  # what another attempt would repeat: not retried
    with pytest.raises(JudgeError, match=f"judge at {refused.base_url}/chat/completions refused the request: "
                                         "HTTP 401 \\(no API key\\? set JUDGE_API_KEY\\)"):
        judge_at(refused).score_sync("q", "r")
    assert len(refused.requests) == 1

    nobody = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(JudgeError, match=f"judge at {nobody}/chat/completions unreachable: .*gave up after 2 attempts"):
        Judge(nobody, MODEL, retries=1, backoff=0.01).score_sync("q", "r")


def test_the_same_prompt_is_judged_once(serve):
    server = serve(delay=0.1)
    judge = judge_at(server)
    assert judge.score_sync("q", "r", "a") == judge.score_sync("q", "r", "a") == pytest.approx(0.7)
    assert len(server.requests) == 1

    async def group():  # identical answers of one group, asked while the first is in flight
        return await asyncio.gather(*(judge.score("q", "same") for _ in range(5)))

    assert asyncio.run(group()) == [pytest.approx(0.7)] * 5
    assert len(server.requests) == 2
    judge.score_sync("q", "r", "another reference")  # another prompt
    assert len(server.requests) == 3
    assert judge.counts() == {"calls": 8, "cache_hits": 5, "retries": 0, "failures": 0}

    small = judge_at(server, cache_size=1)  # bounded: the oldest is forgotten
    for response in ("x", "y", "x", "x"):
        small.score_sync("q", response)
    assert len(server.requests) == 6 and small.counts()["cache_hits"] == 1


def test_a_cancelled_call_neither_hangs_nor_fails_the_calls_waiting_on_its_request(serve):
    """A call cut by its timeout while others wait for its request: one of them asks again. A waiter cut by its
    timeout leaves the request it waited for going on."""
    server = serve(delay=0.3)
    judge = judge_at(server)

    async def main():
        first = asyncio.create_task(judge.score("q", "r"))
        await asyncio.sleep(0.05)
        waiting = [asyncio.create_task(judge.score("q", "r")) for _ in range(2)]
        await asyncio.sleep(0.05)
        first.cancel()  # the request the others wait for
        waiting[1].cancel()  # a waiter
        return await asyncio.gather(first, *waiting, return_exceptions=True)

    first, waiter, cancelled_waiter = asyncio.run(main())
    assert isinstance(first, asyncio.CancelledError) and isinstance(cancelled_waiter, asyncio.CancelledError)
    assert waiter == pytest.approx(0.7) and len(server.requests) == 2
    assert judge.score_sync("q", "r") == pytest.approx(0.7) and len(server.requests) == 2  # cached


def test_a_judge_needs_a_response_placeholder_and_an_http_url():
    with pytest.raises(ValueError, match="no \\{response\\} placeholder"):
        Judge("http://127.0.0.1:1/v1", MODEL, rubric="Rate {question}")
    with pytest.raises(ValueError, match="http:// or https://"):
        Judge("127.0.0.1:1/v1", MODEL)


# ----------------------------------------------------------------------------------------------
# the env file, through the trainer's Env


def test_env_file_scores_and_a_failing_judge_is_an_env_error_not_zero(serve, monkeypatch):
    good = serve(reply=lambda prompt: "Correct. <score>9</score>" if "Question:\nWhat is 2+2?" in prompt else "?")
    down = serve(failures=100, status=503)
    for server, expected in ((good, 0.9), (down, None)):
        args = {"judge_base_url": server.base_url, "judge_model": MODEL, "judge_retries": 1}
        with Env(ENV_FILE, args=args, timeout=10) as env:
            (result,) = env.rewards([CONVERSATION], ["4"])
            faults = env.fault_counts()
        assert result.value == (pytest.approx(expected) if expected is not None else None)
        if expected is None:  # no reward, an error for the trainer to count: not 0.0
            assert result.error.startswith(f"reward_fn raised JudgeError: judge at {down.base_url}/chat/completions "
                                           "failed with HTTP 503")
            assert faults == {"judge_retries": 1} and len(down.requests) == 2
        else:
            assert result.error is None and faults == {}
    prompt = good.requests[0]["body"]["messages"][0]["content"]  # the default rubric, filled in
    assert "Question:\nWhat is 2+2?\n" in prompt and "answer (may be empty):\n4\n" in prompt
    assert "Response:\nIt is 4.\n" in prompt and prompt.endswith("<score>N</score>.")

    monkeypatch.delenv("JUDGE_BASE_URL", raising=False)
    with pytest.raises(EnvError, match="set rollout.env_args.judge_base_url and judge_model"):
        Env(ENV_FILE, args={"judge_model": MODEL})


# ----------------------------------------------------------------------------------------------
# rl2's own OpenAI-compatible server


def test_a_judge_on_rl2s_openai_server_scores_or_raises():
    """A judge pointed at rl2's server (a scripted engine's replies): a reply with a score scores, one without
    raises, never 0."""
    from rl2.chat.tool_parsers import get_tool_parser
    from rl2.engines import SamplingParams
    from rl2.serve.openai_server import OpenAIServer
    from rl2.serve.session import AgentSession
    from rl2.testing.tiny import build_tiny_tokenizer
    from scripted_engine import ScriptedEngine

    tokenizer = build_tiny_tokenizer(template="qwen2.5")
    server = OpenAIServer(tokenizer)
    try:
        for reply, expected in (("Fine. <score>8</score>", 0.8), ("I would rather not say.", None)):
            engine = ScriptedEngine(tokenizer, lambda text: reply if "A: It is 4." in text else "<score>0</score>")
            outcomes = []

            async def episode(i: int, key: str) -> None:
                judge = Judge(server.base_url, server.model_name, rubric=RUBRIC, api_key=key, retries=0)
                try:
                    outcomes.append(await judge.score("What is 2+2?", "It is 4.", "4"))
                except JudgeError as error:
                    outcomes.append(error)

            server.serve_rollout(engine, [AgentSession(tokenizer, get_tool_parser("hermes"))], episode,
                                 SamplingParams(max_new_tokens=32), 0, 2, 4096)
            (outcome,) = outcomes
            if expected is None:
                assert isinstance(outcome, JudgeError)
                assert f"judge at {server.base_url}/chat/completions (model 'rl2-policy') gave no score" in str(outcome)
            else:
                assert outcome == pytest.approx(expected)
    finally:
        server.close()
