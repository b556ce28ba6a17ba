"""`--api-key` on the code and retrieval services: no key or a wrong key gets 401 with a JSON error, the right
key the normal answer, the health check stays open; rl2's clients and the env files send the key; no key
shows in a log line, a repr or an error."""

import asyncio
import json
import shutil
import urllib.error
import urllib.request

import pytest

from retrieval_helpers import SAMPLE_CORPUS, running
from server_process import ServerProcess
from rl2.rollout.env_file import EnvArgs, load_env_file
from rl2.tools.code_client import CodeClient
from rl2.tools.search_client import SearchError, retrieve

KEY = "s3cret-key-0123456789"


def request(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def assert_refused(status: int, body: dict, reason: str) -> None:
    assert status == 401 and reason in body["detail"] and "Bearer" in body["detail"]
    assert KEY not in json.dumps(body)


@pytest.fixture(scope="module")
def code_server():
    server = ServerProcess("rl2.tools.code_server", ["--host", "127.0.0.1", "--port", "0", "--workers", "1",
                                                     "--api-key", KEY], r"code service ready at (http://\S+)",
                           "code server")
    try:
        yield server, server.wait_ready(60)
    finally:
        server.stop()
    assert not any(KEY in line for line in server.lines), "the key was logged"


def test_code_service_needs_the_key(code_server):
    server, url = code_server
    program = {"type": "python", "solution": "print(6 * 7)"}
    assert_refused(*request(f"{url}/run", program), "no API key")
    assert_refused(*request(f"{url}/run", program, key="wrong"), "wrong API key")
    status, answer = request(f"{url}/run", program, key=KEY)
    assert status == 200 and answer["stdout"] == "42\n"
    assert request(f"{url}/ping") == (200, "pong")  # health checks stay open
    assert_refused(*request(f"{url}/status"), "no API key")
    assert any("API key required" in line for line in server.lines)


def test_code_client_and_python_tool_send_the_key(code_server, monkeypatch):
    _, url = code_server
    with_key = CodeClient(url, api_key=KEY, retries=0)
    assert with_key.run_sync("print(6 * 7)")["stdout"] == "42\n"
    assert KEY not in repr(with_key) and "api_key=set" in repr(with_key)
    refused = CodeClient(url, retries=0).run_sync("print(1)")
    assert not refused["run_success"] and "401" in refused["stderr"] + refused.get("reason", "") + str(refused)
    assert KEY not in json.dumps(refused)

    tool = load_env_file("envs/python_tool.py", EnvArgs({"code_server_url": url, "code_server_api_key": KEY}))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    replies = asyncio.run(tool.interact([{"role": "assistant", "content": call}]))
    assert replies[0]["content"] == "42"
    tool._code_client.close()


def test_retrieval_service_and_search_env_send_the_key(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(SAMPLE_CORPUS, corpus)
    monkeypatch.setenv("RETRIEVAL_API_KEY", KEY)  # the server's documented variable
    with running(str(corpus)) as server:
        monkeypatch.delenv("RETRIEVAL_API_KEY")
        url = server.url
        query = {"queries": ["capital of France"], "topk": 1}
        assert_refused(*request(f"{url}/retrieve", query), "no API key")
        assert_refused(*request(f"{url}/retrieve", query, key="wrong"), "wrong API key")
        status, answer = request(f"{url}/retrieve", query, key=KEY)
        assert status == 200 and len(answer["result"][0]) == 1
        assert request(f"{url}/health")[0] == 200
        hits = asyncio.run(retrieve(["capital of France"], f"{url}/retrieve", topk=1, api_key=KEY))
        assert len(hits[0]) == 1
        with pytest.raises(SearchError, match="HTTP 401") as error:
            asyncio.run(retrieve(["capital of France"], f"{url}/retrieve", topk=1, retries=0))
        assert KEY not in str(error.value)
        search = load_env_file("envs/search.py", EnvArgs({"search_url": f"{url}/retrieve", "search_api_key": KEY}))
        replies = asyncio.run(search.interact([{"role": "assistant", "content": "<search>capital of France</search>"}]))
        assert replies[0]["content"].startswith("<information>")
        log = server.log()
    assert "API key required" in log and KEY not in log
