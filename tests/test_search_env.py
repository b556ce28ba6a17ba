"""The Search-R1 env file (`envs/search.py`) and the retrieval client (`rl2.tools.search_client`):
exact-match rewards, interact against a real retrieval server process, retries (counted) and
failures (env errors, not messages to the model), and a whole multi-turn rollout through rl2's
rollout loop with a scripted policy."""

import asyncio
import importlib.util
import json
import os
import re
import shutil
import time

import pytest
from aiohttp import web
from transformers import AutoTokenizer

from retrieval_helpers import SAMPLE_CORPUS, running
from server_process import REPO, free_port, serving
from conftest import tokenize_prompt
from rl2.engines import Engine, Generation, SamplingParams
from rl2.rollout.env import Env
from rl2.rollout.multi_turn import assign_rewards, rollout
from rl2.tools.faults import FaultCounter
from rl2.tools.search_client import SearchError, passages_to_string, retrieve

ENV_PATH = os.path.join(REPO, "envs", "search.py")


@pytest.fixture(scope="module")
def search_env():
    """envs/search.py as a plain module, to call its functions directly."""
    spec = importlib.util.spec_from_file_location("search_env_under_test", ENV_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    corpus = tmp_path_factory.mktemp("corpus") / "search_corpus.jsonl"
    shutil.copy(SAMPLE_CORPUS, corpus)
    with running(str(corpus)) as server:
        yield server


@pytest.fixture
def search_url(server, monkeypatch) -> str:
    url = f"{server.url}/retrieve"
    monkeypatch.setenv("SEARCH_URL", url)
    for name in ("SEARCH_TOPK", "SEARCH_TIMEOUT", "SEARCH_RETRIES"):
        monkeypatch.delenv(name, raising=False)
    return url


def assistant(content: str) -> list[dict]:
    return [{"role": "user", "content": "Question: ?"}, {"role": "assistant", "content": content}]


# ----------------------------------------------------------------------------------------------
# reward


REWARD_CASES = [
    # (final assistant message, gold answer(s), reward)
    ("<answer>Canberra</answer>", ["Canberra"], 1.0),
    ("<answer> canberra </answer>", ["Canberra"], 1.0),  # case, surrounding spaces
    ("<answer>CANBERRA.</answer>", "Canberra", 1.0),  # punctuation; a plain-string gold
    ("<answer>The Louvre</answer>", ["Louvre"], 1.0),  # article
    ("<answer>Louvre</answer>", ["the Louvre"], 1.0),  # article on the gold side
    ("<answer>an apple</answer>", ["apple"], 1.0),
    ("<answer>a   Swiss\n franc</answer>", ["Swiss franc"], 1.0),  # whitespace and newlines
    ("<answer>Jorn Utzon!</answer>", ["Jørn Utzon", "Jorn Utzon"], 1.0),  # any gold in the list
    ("<answer>Alexander Graham-Bell</answer>", ["Alexander Graham Bell"], 0.0),  # hyphen dropped, words glued
    ("<answer>Martin Luther King, Jr.</answer>", ["Martin Luther King Jr"], 1.0),
    ("<answer>1949</answer>", ["1949"], 1.0),
    ("<answer>1949</answer>", 1949, 1.0),  # a number as gold
    ("<answer>206 bones</answer>", ["206"], 0.0),  # exact match, not containment
    ("<answer>Paris</answer>", ["Canberra"], 0.0),
    ("<answer></answer>", ["Canberra"], 0.0),
    ("<answer>the</answer>", [""], 1.0),  # both normalise to nothing (as in Search-R1)
    ("Canberra", ["Canberra"], 0.0),  # no answer tag
    ("<answer>Canberra", ["Canberra"], 0.0),  # unclosed tag
    ("<answer>Sydney</answer> no wait <answer>Canberra</answer>", ["Canberra"], 1.0),  # the last answer counts
    ("<answer>Canberra</answer> hmm <answer>Sydney</answer>", ["Canberra"], 0.0),
    ("<think>maybe <answer>x</answer>?</think>\n<answer>\nCanberra\n</answer>", ["Canberra"], 1.0),
    ("<answer>Canberra</answer>", [], 0.0),  # no gold answers
    ("<answer>Canberra</answer>", {"target": ["Canberra"]}, 1.0),  # Search-R1's ground-truth dict
    ("<ANSWER>Canberra</ANSWER>", ["Canberra"], 0.0),  # tags are case-sensitive, as in Search-R1
]


@pytest.mark.parametrize("content,gold,reward", REWARD_CASES)
def test_reward_table(search_env, content, gold, reward):
    assert search_env.reward_fn(assistant(content), gold) == reward


def test_reward_reads_the_final_assistant_message(search_env):
    messages = assistant("<answer>Canberra</answer>") + [{"role": "tool", "content": "<answer>Sydney</answer>"}]
    assert search_env.reward_fn(messages, ["Canberra"]) == 1.0  # a trailing tool message is not the model's
    earlier_only = assistant("<answer>Canberra</answer>") + [{"role": "assistant", "content": "I give up."}]
    assert search_env.reward_fn(earlier_only, ["Canberra"]) == 0.0  # only the final assistant message counts
    assert search_env.reward_fn([{"role": "user", "content": "<answer>Canberra</answer>"}], ["Canberra"]) == 0.0


def test_prompt_is_search_r1s(search_env):
    prompt = search_env.make_prompt("  What is the capital of Australia? ")
    assert prompt.startswith("Answer the given question. You must conduct reasoning inside <think> and </think>")
    assert prompt.endswith("<answer> Beijing </answer>. Question: What is the capital of Australia?\n")
    with open(os.path.join(REPO, "recipes", "data", "search_qa.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) >= 30
    for row in rows:
        (message,) = row["messages"]
        assert message["role"] == "user" and message["content"].startswith(search_env.PROMPT.split("{")[0])
        assert isinstance(row["answer"], list) and all(isinstance(a, str) and a for a in row["answer"])


# ----------------------------------------------------------------------------------------------
# interact


def test_search_returns_information_with_the_right_document(search_env, search_url):
    (message,) = asyncio.run(search_env.interact(assistant("<think>I need to look it up.</think>\n<search> Night Watch painter </search>")))
    assert message["role"] == "tool"
    content = message["content"]
    assert content.startswith("<information>Doc 1(Title: The Night Watch) The Night Watch is a work by the artist Rembrandt.")
    assert content.endswith("</information>") and "\n</information>" not in content
    assert re.findall(r"Doc (\d)\(Title: ", content) == ["1", "2", "3"]  # SEARCH_TOPK defaults to 3


def test_search_topk_setting(search_env, search_url, monkeypatch):
    monkeypatch.setenv("SEARCH_TOPK", "1")
    (message,) = asyncio.run(search_env.interact(assistant("<search>capital of Peru</search>")))
    assert re.findall(r"Doc (\d)\(Title: ", message["content"]) == ["1"]
    monkeypatch.setenv("SEARCH_TOPK", "many")
    with pytest.raises(ValueError, match="SEARCH_TOPK='many'"):
        asyncio.run(search_env.interact(assistant("<search>capital of Peru</search>")))


def test_answer_ends_and_other_turns_are_invalid(search_env, search_url):
    assert asyncio.run(search_env.interact(assistant("<think>I know it.</think>\n<answer> Canberra </answer>"))) == []
    # An answer wins over a search in the same turn: the trajectory ends with that answer.
    assert asyncio.run(search_env.interact(assistant("<search>x</search><answer>Canberra</answer>"))) == []
    for content in ["I think it is Canberra.", "<search>unclosed", "<search>  </search>", "<think>hmm</think>"]:
        assert asyncio.run(search_env.interact(assistant(content))) == [{"role": "tool", "content": search_env.INVALID_ACTION}]
    assert search_env.INVALID_ACTION.startswith("My previous action is invalid.")


def test_no_match_gives_empty_information(search_env, search_url):
    (message,) = asyncio.run(search_env.interact(assistant("<search>zxqv</search>")))
    assert message == {"role": "tool", "content": "<information></information>"}


def test_dead_service_is_an_env_error_not_a_message(search_env, monkeypatch):
    """A search that fails after its retries raises (rl2.rollout.env counts an env error and leaves the
    trajectory out of training); the model is never shown a failure message; retries are counted."""
    url = f"http://127.0.0.1:{free_port()}/retrieve"
    monkeypatch.setenv("SEARCH_URL", url)
    monkeypatch.setenv("SEARCH_RETRIES", "2")
    before = search_env.faults.counts().get("search_retries", 0)
    start = time.perf_counter()
    with pytest.raises(SearchError, match=f"retrieval service at {re.escape(url)} failed \\(3 attempts\\)"):
        asyncio.run(search_env.interact(assistant("<search>capital of Peru</search>")))
    assert time.perf_counter() - start < 10  # backoff 0.5 + 1 s and refused connections
    assert search_env.faults.counts()["search_retries"] - before == 2

    messages = [assistant("<search>capital of Peru</search>"), assistant("<answer>Lima</answer>")]
    with Env(ENV_PATH, timeout=30, need_interact=True) as env:
        failed, answered = env.interact(messages)
        assert env.fault_counts() == {"search_retries": 2}
    assert failed.value == [] and failed.error.startswith("interact raised SearchError: retrieval service at " + url)
    assert answered.value == [] and answered.error is None  # an answer needs no search


# ----------------------------------------------------------------------------------------------
# the client


def test_client_against_the_server(server):
    hits = asyncio.run(retrieve(["Great Barrier Reef", "Volga river Europe"], f"{server.url}/retrieve", topk=2))
    assert [len(row) for row in hits] == [2, 2]
    assert hits[1][0]["document"]["contents"].startswith("Volga\n") and hits[1][0]["score"] > hits[1][1]["score"]
    text = passages_to_string(hits[1])
    assert text.startswith("Doc 1(Title: Volga) The Volga is the longest river in Europe.") and text.endswith("\n")
    # Bare documents (return_scores false) render the same.
    assert passages_to_string([hit["document"] for hit in hits[1]]) == text


def test_client_retries_5xx_and_not_4xx():
    calls = {"flaky": 0, "reject": 0}

    async def flaky(request):
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            return web.json_response({"error": "warming up"}, status=503)
        return web.json_response({"result": [[{"document": {"id": "1", "contents": "T\nx"}, "score": 1.0}]]})

    async def reject(request):
        calls["reject"] += 1
        return web.json_response({"error": "'topk' must be an integer"}, status=400)

    async def garbled(request):
        return web.Response(text="<html>oops</html>")

    async def always_down(request):
        return web.json_response({"error": "index is loading"}, status=500)

    faults = FaultCounter()
    app = web.Application()
    for name, handler in [("flaky", flaky), ("reject", reject), ("garbled", garbled), ("down", always_down)]:
        app.router.add_post(f"/{name}", handler)

    async def main():
        async with serving(app) as url:
            ok = await retrieve(["q"], f"{url}/flaky", backoff=0.01, faults=faults)
            errors = []
            for path in ("reject", "garbled", "down"):
                with pytest.raises(SearchError) as error:
                    await retrieve(["q"], f"{url}/{path}", retries=2, backoff=0.01)
                errors.append(str(error.value))
            return ok, errors

    ok, (rejected, garbled_error, down) = asyncio.run(main())
    assert ok == [[{"document": {"id": "1", "contents": "T\nx"}, "score": 1.0}]] and calls["flaky"] == 3
    assert faults.counts() == {"search_retries": 2}
    assert "refused the request: HTTP 400: 'topk' must be an integer" in rejected and calls["reject"] == 1
    assert "other than JSON" in garbled_error
    assert "failed (3 attempts): HTTP 500: index is loading" in down


def test_client_timeout():
    async def slow(request):
        await asyncio.sleep(1)  # past the client's timeout; short, as the server's shutdown waits for it
        return web.json_response({"result": [[]]})

    app = web.Application()
    app.router.add_post("/retrieve", slow)

    async def main():
        async with serving(app) as url:
            start = time.perf_counter()
            with pytest.raises(SearchError, match="failed \\(2 attempts\\): TimeoutError"):
                await retrieve(["q"], f"{url}/retrieve", timeout=0.2, retries=1, backoff=0.01)
            return time.perf_counter() - start

    assert asyncio.run(main()) < 2


# ----------------------------------------------------------------------------------------------
# a whole rollout


class ScriptedEngine(Engine):
    """Replies with `policy(text of the conversation so far)`, ending each turn on its stop string
    (as an engine with `stop=["</search>", "</answer>"]` does)."""

    def __init__(self, tokenizer, policy):
        self.tokenizer, self.policy = tokenizer, policy

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            reply = self.policy(self.tokenizer.decode(prompt, skip_special_tokens=False))
            tokens = self.tokenizer(reply, add_special_tokens=False)["input_ids"][: params.max_new_tokens]
            out.append(Generation(token_ids=tokens, logprobs=[-0.5] * len(tokens), finish_reason="stop"))
        return out

    def update_weights(self, named_tensors, partial=False):
        raise NotImplementedError


def two_hop_policy(text: str) -> str:
    """Find where Machu Picchu is, then that country's capital, then answer: reads only what the
    searches returned (the prompt's own mention of <information> comes before the first reply)."""
    information = re.findall(r"<information>(.*?)</information>", text.split("<|im_start|>assistant", 1)[1], re.DOTALL)
    if not information:
        return "<think>I need to find where Machu Picchu is.</think>\n<search> Machu Picchu </search>"
    if len(information) == 1:
        country = re.search(r"Andes mountains of (\w+)", information[0]).group(1)
        return f"<think>It is in {country}.</think>\n<search> capital of {country} </search>"
    capital = re.search(r"(\w+) is the capital city of", information[1]).group(1)
    return f"<think>Found it.</think>\n<answer> {capital} </answer>"


def test_two_hop_rollout_through_rl2(search_env, search_url, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = []
    for question, answer in [("What is the capital of the country where Machu Picchu is?", ["Lima"]),
                             ("What is the capital of Peru's neighbour to the south?", ["Santiago"])]:
        messages = [{"role": "user", "content": search_env.make_prompt(question)}]
        prompts.append({"prompt_ids": tokenize_prompt(messages, tokenizer), "messages": messages, "answer": answer})
    engine = ScriptedEngine(tokenizer, two_hop_policy)
    params = SamplingParams(max_new_tokens=64, stop=["</search>", "</answer>"])
    with Env(ENV_PATH, timeout=10, need_interact=True) as env:
        trajectories = rollout(engine, env, tokenizer, prompts, 1, params, max_turns=4)
        assign_rewards(env, trajectories)

    for trajectory in trajectories:
        assert [m["role"] for m in trajectory.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert trajectory.turns == 3 and trajectory.done and not trajectory.truncated and not trajectory.errors
        first_search, second_search = trajectory.messages[2]["content"], trajectory.messages[4]["content"]
        assert first_search.startswith("<information>Doc 1(Title: Machu Picchu)")
        assert "Lima is the capital city of Peru." in second_search
        assert trajectory.messages[-1]["content"].endswith("<answer> Lima </answer>")
        # Tool text is never an action: the generated tokens are exactly the three replies.
        generated = [t for t, m in zip(trajectory.token_ids, trajectory.action_mask) if m]
        replies = "".join(m["content"] for m in trajectory.messages if m["role"] == "assistant")
        assert tokenizer.decode(generated) == replies
    assert [t.reward for t in trajectories] == [1.0, 0.0]


# ----------------------------------------------------------------------------------------------
# envs/search_tool.py: the same search as a native tool


def test_search_tool_is_a_typed_function_and_a_dead_service_an_env_error(search_url, monkeypatch):
    path = os.path.join(REPO, "envs", "search_tool.py")
    with Env(path, timeout=30, workers=0) as env:
        assert env.tools["search"].schema["function"]["parameters"]["required"] == ["query"]
        with env.interactions() as interactions:
            found, empty = interactions.call_tools([("search", {"query": "Night Watch painter"}),
                                                    ("search", {"query": " "})]).result(timeout=60)
        assert found.content.startswith("Doc 1(Title: The Night Watch) The Night Watch is a work by the artist")
        assert found.error is None and empty.content == "Error: search raised ValueError: the query is empty"
        monkeypatch.setenv("SEARCH_URL", f"http://127.0.0.1:{free_port()}/retrieve")
        monkeypatch.setenv("SEARCH_RETRIES", "1")
        with env.interactions() as interactions:
            (dead,) = interactions.call_tools([("search", {"query": "capital of Peru"})]).result(timeout=60)
        assert dead.env_error.startswith("tool search: search raised ToolUnavailable: retrieval service at")
        assert env.fault_counts() == {"search_retries": 1}
