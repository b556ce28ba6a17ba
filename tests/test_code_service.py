"""The code-judge-compatible code service (`rl2.tools.code_server`) and its client
(`rl2.tools.code_client`): real server processes on 127.0.0.1, the API's shapes and errors,
batching, concurrency bounds, retries, and a service that dies or is not there."""

import asyncio
import shutil
import time

import pytest
from aiohttp import web

from rl2.tools.code_client import CodeClient
from rl2.tools.code_server import Submission, judge_result, make_app
from rl2.tools.sandbox import RunResult, Sandbox
from clients import rstar2_agent
from server_process import ServerProcess, free_port, request, serving


class Server(ServerProcess):
    """`python -m rl2.tools.code_server` in a subprocess (2 workers, 1 s per program)."""

    def __init__(self, port: int = 0, *args: str):
        super().__init__("rl2.tools.code_server", ["--host", "127.0.0.1", "--port", str(port), "--workers", "2",
                                                   "--timeout", "1", *args],
                         r"code service ready at (http://\S+)", "code server")


def py(solution: str, **fields) -> dict:
    return {"type": "python", "solution": solution, **fields}


@pytest.fixture(scope="module")
def server():
    """A code server (2 workers, 1 s time limit, 1 MB request limit) shared by the module's tests."""
    server = Server(0, "--max-request-mb", "1")
    server.wait_ready()
    yield server
    assert server.stop() == 0, server.log()
    assert "sandbox closed" in server.log()


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(workers=2, timeout=5) as box:
        yield box


# ----------------------------------------------------------------------------------------------
# the server's API


def test_run_single_ok_error_timeout(server):
    url = server.url

    async def main():
        return await asyncio.gather(
            request("POST", url + "/run", json=py("print(input()[::-1])", input="abc", sub_id="s1")),
            request("POST", url + "/run", json=py("print(input())", input="a", expected_output="b")),
            request("POST", url + "/run", json=py("print(' 7 ')", expected_output="7\n")),
            request("POST", url + "/run", json=py("import sys\nprint('partial')\nsys.exit(3)")),
            request("POST", url + "/run", json=py("raise ValueError('boom')")),
            request("POST", url + "/run", json=py("while True: pass")),
            request("POST", url + "/judge", json=py("print(1)", expected_output="1")),
        )

    (s1, ok), (s2, mismatch), (s3, match), (s4, exit3), (s5, raised), (s6, slow), (s7, judged) = asyncio.run(main())
    assert {s1, s2, s3, s4, s5, s6, s7} == {200}
    assert set(ok) == {"sub_id", "success", "run_success", "cost", "stdout", "stderr", "reason"}
    assert ok["sub_id"] == "s1" and ok["stdout"] == "cba\n" and ok["stderr"] == ""
    assert ok["success"] is True and ok["run_success"] is True and ok["reason"] == ""
    assert isinstance(ok["cost"], float) and 0 < ok["cost"] < 1
    assert mismatch["run_success"] is True and mismatch["success"] is False  # ran, but the output differs
    assert match["success"] is True  # compared after stripping, as code-judge does
    assert exit3["stdout"] == "partial\n" and exit3["run_success"] is False and exit3["success"] is False
    assert exit3["reason"] == ""
    assert "ValueError: boom" in raised["stderr"] and raised["run_success"] is False
    assert slow["reason"] == "worker_timeout" and slow["run_success"] is False and slow["success"] is False
    assert 0.9 < slow["cost"] < 5
    assert judged["success"] is True and "stdout" not in judged and "stderr" not in judged


def test_batch_and_long_batch_concurrently_in_order(server):
    def batch(b: int, with_ids: bool) -> dict:
        # later submissions finish sooner, so completion order differs from submission order
        subs = [py(f"import time\ntime.sleep({(4 - i) * 0.03})\nprint({b * 100 + i})") for i in range(5)]
        if with_ids:
            for i, sub in enumerate(subs):
                sub["sub_id"] = f"b{b}-{i}"
        return {"type": "batch", "sub_id": f"batch-{b}", "submissions": subs}

    async def main():
        calls = [request("POST", server.url + ("/run/batch" if b % 2 else "/run/long-batch"), json=batch(b, b < 3))
                 for b in range(6)]
        return await asyncio.gather(*calls)

    for b, (status, answer) in enumerate(asyncio.run(main())):
        assert status == 200 and answer["sub_id"] == f"batch-{b}"
        assert [r["stdout"] for r in answer["results"]] == [f"{b * 100 + i}\n" for i in range(5)]
        assert all(r["success"] and r["run_success"] and r["reason"] == "" for r in answer["results"])
        ids = [r["sub_id"] for r in answer["results"]]
        if b < 3:
            assert ids == [f"b{b}-{i}" for i in range(5)]
        else:
            assert len(set(ids)) == 5 and all(isinstance(i, str) and i for i in ids)


@pytest.mark.parametrize("method,path,body,status,needle", [
    ("POST", "/run", {"data": b"not json"}, 422, "not valid JSON"),
    ("POST", "/run", {"json": ["print(1)"]}, 422, "JSON object"),
    ("POST", "/run", {"json": {"type": "python"}}, 422, "'solution'"),
    ("POST", "/run", {"json": {"solution": "print(1)"}}, 422, "'type' is missing"),
    ("POST", "/run", {"json": {"type": "python", "solution": 5}}, 422, "'solution' must be a string"),
    ("POST", "/run", {"json": py("print(1)", input=3)}, 422, "'input' must be a string"),
    ("POST", "/run/batch", {"json": {"type": "batch", "submissions": []}}, 422, "non-empty"),
    ("POST", "/run/batch", {"json": py("print(1)")}, 422, "type must be 'batch'"),
    ("POST", "/run/long-batch", {"json": {"submissions": [py("print(1)"), {"type": "rust", "solution": "x"}]}},
     422, "unsupported type 'rust'"),
    ("POST", "/run", {"json": py("x" * (2 * 1024 * 1024))}, 413, "exceeded"),
    ("GET", "/run", {}, 405, "Method Not Allowed"),
    ("GET", "/nowhere", {}, 404, "Not Found"),
])
def test_bad_requests_get_json_errors(server, method, path, body, status, needle):
    got, answer = asyncio.run(request(method, server.url + path, **body))
    assert got == status, answer
    assert needle in str(answer["detail"])
    if status == 422:  # FastAPI's shape: a list of {type, loc, msg}
        (detail,) = answer["detail"]
        assert set(detail) == {"type", "loc", "msg"} and detail["loc"][0] == "body"


def test_code_judge_semantics(server):
    """What code-judge answers, case by case: a timed-out program's last line (and nothing it
    printed after its limit: code-judge's `test_cpp_timeout`), a long output cut to 1,000 characters
    without failing (compared before the cut), C++ next to Python in one batch, and a type the
    service cannot run answered per submission, not by rejecting the batch."""
    long_output = "print('7' * 1500)"
    cpp = "#include <cstdio>\nint main(){char s[8]; scanf(\"%7s\", s); printf(\"<%s>\", s); return 0;}"
    sleeps_its_limit = "#include <cstdio>\n#include <unistd.h>\nint main(){sleep(1);printf(\"a\");return 0;}"
    body = {"type": "batch", "submissions": [
        py("import time\nprint('before', flush=True)\ntime.sleep(5)"),
        py(long_output, expected_output="7" * 1500),
        {"type": "cpp", "solution": cpp, "input": "abc", "expected_output": "<abc>"},
        {"type": "cpp", "solution": "int main(){return 0}"},
        {"type": "math", "solution": "1+1", "expected_output": "2"},
        py("print(1)", expected_output="1"),
        {"type": "cpp", "solution": sleeps_its_limit, "expected_output": "a"},
    ]}
    status, answer = asyncio.run(request("POST", server.url + "/run/long-batch", json=body))
    assert status == 200
    timed_out, long, compiled, broken, math, plain, late = answer["results"]
    assert timed_out["stdout"] == "before\nSuicide from timeout.\n" and timed_out["reason"] == "worker_timeout"
    assert (long["run_success"], long["success"], long["stdout"], long["reason"]) == (True, True, "7" * 1000, "")
    if shutil.which("g++"):
        assert (compiled["success"], compiled["stdout"], compiled["reason"]) == (True, "<abc>", "")
        assert broken["run_success"] is False and broken["reason"] == "" and "error" in broken["stderr"]
        assert (late["stdout"], late["reason"], late["success"]) == ("Suicide from timeout.\n", "worker_timeout", False)
    assert (math["run_success"], math["reason"], math["stdout"]) == (False, "internal_error", None)
    assert "type 'math' cannot run" in math["stderr"]
    assert plain["success"] is True


def test_cpp_without_a_compiler_is_answered_per_submission(sandbox):
    class PythonOnly:
        languages = ("python",)

        def run(self, code: str, stdin: str):
            return sandbox.run(code, stdin)

    body = {"submissions": [{"type": "cpp", "solution": "int main(){}"}, py("print(2)")]}

    async def main():
        async with serving(make_app(PythonOnly(), workers=1)) as url:
            return await request("POST", url + "/run/batch", json=body)

    status, answer = asyncio.run(main())
    cpp, python = answer["results"]
    assert status == 200 and python["stdout"] == "2\n"
    assert (cpp["reason"], cpp["stdout"], cpp["stderr"]) == ("internal_error", None, "type 'cpp' cannot run: g++ is not installed here")


def test_rstar2_agent_tool_calls(server):
    """rStar2-Agent's code tool (tests/clients/rstar2_agent.py) against the server: a Jupyter-like
    session replayed from history, stdin, an error reported through `os._exit(1)`, a timeout."""
    history = [{"name": "jupyter_code", "arguments": {"code": "x = 20\nprint('not shown')"}},
               {"name": "jupyter_code", "arguments": {"code": "undefined_name"}}]  # failed earlier: ignored now
    calls = [
        {"name": "jupyter_code", "arguments": {"code": "y = x + 1\ny * 2"}, "history_tool_calls": history},
        {"name": "python_code_with_standard_io", "arguments": {"code": "print(input()[::-1])", "input": "abc"}},
        {"name": "jupyter_code", "arguments": {"code": "print('partial')\n1 / 0"}},
        {"name": "jupyter_code", "arguments": {"code": "x = 1\ny = x / 0\nprint(y)"}},
        {"name": "jupyter_code", "arguments": {"code": "while True: pass"}},
    ]
    replayed, stdio, failed, located, slow = rstar2_agent.run_tool_calls(server.url, calls)
    assert replayed.startswith("Tool call success\nstdout: 42\n\nexecution time: ")
    assert stdio.startswith("Tool call success\nstdout: cba\n\nexecution time: ")
    assert failed.startswith("Tool call failure\nreason: \nstdout: partial\n\n"
                             "stderr: ZeroDivisionError: division by zero\n\nexecution time: ")
    assert located.startswith("Tool call failure\nreason: \nstderr: ZeroDivisionError at line 2: division by zero\n"
                              "  y = x / 0\n\nexecution time: ")
    assert slow.startswith("Tool call failure\nreason: worker_timeout\nstdout: Suicide from timeout.\n\n")


def test_bad_item_in_batch_is_located(server):
    body = {"submissions": [py("print(1)"), py("print(2)"), {"type": "python"}]}
    status, answer = asyncio.run(request("POST", server.url + "/run/batch", json=body))
    assert status == 422 and answer["detail"][0]["loc"] == ["body", "submissions", 2, "solution"]


def test_ping_and_status(server):
    assert asyncio.run(request("GET", server.url + "/ping")) == (200, "pong")
    assert asyncio.run(request("GET", server.url + "/status")) == (200, {"queue": 0, "num_workers": 2})


def test_result_mapping_to_code_judge():
    sub = Submission("id", "python", "code", "", None)
    expecting = Submission("id", "python", "code", "", "42")

    def mapped(reason: str, stdout: str = "", sub: Submission = sub) -> tuple:
        result = judge_result(sub, RunResult(stdout, "", 0 if reason == "ok" else 1, 0.5, reason))
        return result["success"], result["run_success"], result["reason"]

    assert mapped("ok") == (True, True, "")
    assert mapped("ok", "42\n", expecting) == (True, True, "")
    assert mapped("ok", "41\n", expecting) == (False, True, "")
    assert mapped("error") == (False, False, "")
    assert mapped("timeout") == (False, False, "worker_timeout")
    assert mapped("memory") == (False, False, "")
    assert mapped("output_limit") == (False, False, "")  # the file-size limit: killed by SIGXFSZ
    assert mapped("compile_error") == (False, False, "")
    assert mapped("sandbox_error") == (False, False, "internal_error")
    assert mapped("not_installed") == (False, False, "internal_error")
    cut = judge_result(expecting, RunResult("42\n" + "x" * 50, "", 0, 0.5, "output_limit", truncated=True), 10)
    assert (cut["run_success"], cut["success"], cut["stdout"]) == (True, False, "42\n" + "x" * 7)
    timed_out = judge_result(sub, RunResult("partial\n", "", None, 1.0, "timeout"))
    assert timed_out["stdout"] == "partial\nSuicide from timeout.\n"
    failed = judge_result(sub, RunResult("", "worker died", None, 0.0, "sandbox_error"))
    assert (failed["stdout"], failed["stderr"], failed["reason"]) == (None, "worker died", "internal_error")


def test_queue_timeout_on_batch_not_on_long_batch(sandbox, caplog):
    """/run/batch gives up on a submission that cannot start in time; /run/long-batch waits; the
    client resubmits queue-timed-out submissions."""
    app = make_app(sandbox, workers=1, queue_timeout=0.3)
    body = {"submissions": [py("import time\ntime.sleep(0.8)\nprint('a')"), py("print('b')")]}

    async def main():
        async with serving(app) as url:
            short = await request("POST", url + "/run/batch", json=body)
            long = await request("POST", url + "/run/long-batch", json=body)
            client = CodeClient(url, long_batch=False, retries=3, backoff=0.3)
            retried = await client.run_many([code["solution"] for code in body["submissions"]])
            return short, long, retried, client

    (_, short), (_, long), retried, client = asyncio.run(main())
    assert short["results"][0]["stdout"] == "a\n"
    assert short["results"][1]["reason"] == "queue_timeout" and short["results"][1]["success"] is False
    assert 0.25 < short["results"][1]["cost"] < 0.8
    assert [r["stdout"] for r in long["results"]] == ["a\n", "b\n"]
    assert [r["stdout"] for r in retried] == ["a\n", "b\n"]
    logged = [r.getMessage() for r in caplog.records if r.name == "rl2.tools.code_client"]
    retries = [message for message in logged if "retrying" in message]
    assert retries and all("queue_timeout" in message for message in retries)
    assert client.faults.counts() == {"code_service_retries": len(retries)}


# ----------------------------------------------------------------------------------------------
# the client


def test_client_against_server(server):
    client = CodeClient(server.url, batch_size=3, concurrency=2)
    programs = [f"print({i} * {i})" for i in range(6)] + [("print(input().upper())", "shout")]
    results = asyncio.run(client.run_many(programs))
    assert [r["stdout"] for r in results] == [f"{i * i}\n" for i in range(6)] + ["SHOUT\n"]
    assert all(r["success"] for r in results)
    assert client.run_sync("print(6 * 7)")["stdout"] == "42\n"
    assert client.run_many_sync([]) == []
    assert asyncio.run(client.ping()) is True
    timeout = asyncio.run(client.run("while True: pass"))
    assert timeout["reason"] == "worker_timeout" and timeout["success"] is False


def test_client_batches_and_bounds_requests_in_flight(sandbox):
    """run_many splits into batch_size batches with at most `concurrency` requests at once, also
    across concurrent calls on one client."""
    app = make_app(sandbox, workers=2)
    in_flight, peak, sizes = [0], [0], []

    @web.middleware
    async def count(request, handler):
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        sizes.append(len((await request.json())["submissions"]))
        try:
            return await handler(request)
        finally:
            in_flight[0] -= 1

    app.middlewares.append(count)
    programs = [f"import time\ntime.sleep(0.05)\nprint({i})" for i in range(11)]

    async def main():
        async with serving(app) as url:
            client = CodeClient(url, batch_size=3, concurrency=2)
            results = await client.run_many(programs)
            many_peak, many_sizes = peak[0], list(sizes)
            peak[0] = 0
            singles = await asyncio.gather(*(client.run(programs[i]) for i in range(6)))  # a session each
            singles_peak = peak[0]
            async with client:  # one session for the block
                shared = await asyncio.gather(*(client.run(programs[i]) for i in range(6)))
            return results, many_peak, many_sizes, singles, singles_peak, shared

    results, many_peak, many_sizes, singles, singles_peak, shared = asyncio.run(main())
    assert [r["stdout"] for r in results] == [f"{i}\n" for i in range(11)]
    assert sorted(many_sizes) == [2, 3, 3, 3]
    assert many_peak == 2  # bounded, and the bound was reached
    assert [r["stdout"] for r in singles] == [r["stdout"] for r in shared] == [f"{i}\n" for i in range(6)]
    assert singles_peak == 2 and peak[0] <= 2


def test_client_retries_5xx_and_does_not_retry_4xx():
    calls = {"flaky": 0, "reject": 0, "garbled": 0}

    async def flaky(request):
        calls["flaky"] += 1
        if calls["flaky"] < 3:
            return web.Response(status=503, text="overloaded")
        subs = (await request.json())["submissions"]
        return web.json_response({"sub_id": "x", "results": [
            {"sub_id": s["sub_id"], "success": True, "run_success": True, "cost": 0.0, "stdout": s["solution"],
             "stderr": "", "reason": ""} for s in subs]})

    async def reject(request):
        calls["reject"] += 1
        return web.json_response({"detail": [{"msg": "unsupported"}]}, status=422)

    async def garbled(request):
        calls["garbled"] += 1
        return web.json_response({"sub_id": "x", "results": []})

    app = web.Application()
    app.router.add_post("/flaky/run/long-batch", flaky)
    app.router.add_post("/reject/run/long-batch", reject)
    app.router.add_post("/garbled/run/long-batch", garbled)
    clients = {}

    async def main():
        async with serving(app) as url:
            for path in ("/flaky", "/reject", "/garbled", "/nowhere"):
                clients[path] = CodeClient(url + path, retries=3, backoff=0.01)
            return (await clients["/flaky"].run_many(["a", "b"]), await clients["/reject"].run("a"),
                    await clients["/garbled"].run("a"), await clients["/nowhere"].run("a"), url)

    ok, rejected, wrong, missing, url = asyncio.run(main())
    assert [r["stdout"] for r in ok] == ["a", "b"] and calls["flaky"] == 3
    assert clients["/flaky"].faults.counts() == {"code_service_retries": 2}
    assert rejected["reason"] == "invalid_input" and "HTTP 422" in rejected["stderr"] and calls["reject"] == 1
    assert f"code service at {url}/reject" in rejected["stderr"]
    assert wrong["reason"] == "internal_error" and "do not match" in wrong["stderr"] and calls["garbled"] == 1
    # No code service at that URL: the program could not run (not the program's fault), no retries.
    assert missing["reason"] == "internal_error" and "HTTP 404; is the URL the service's root?" in missing["stderr"]
    assert all(clients[path].faults.counts() == {} for path in ("/reject", "/garbled", "/nowhere"))


def test_client_when_server_is_killed_mid_run():
    server = Server(0, "--timeout", "10")
    url = server.wait_ready()
    client = CodeClient(url, batch_size=2, retries=2, backoff=0.1)

    async def main():
        task = asyncio.create_task(client.run_many(["import time\ntime.sleep(3)\nprint(1)"] * 3))
        await asyncio.sleep(0.7)
        assert not task.done()
        server.kill()
        start = time.monotonic()
        return await task, time.monotonic() - start

    try:
        results, elapsed = asyncio.run(main())
    finally:
        server.kill()
    assert elapsed < 2.0  # backoff 0.1 + 0.2 and refused connections, not a hang
    assert client.faults.counts() == {"code_service_retries": 2 * 2}  # 2 batches, 2 retries each
    for result in results:
        assert result["success"] is False and result["run_success"] is False
        assert result["reason"] == "internal_error"
        assert f"code service at {url} unreachable" in result["stderr"]
        assert "gave up after 3 attempts" in result["stderr"]


def test_client_retries_until_server_comes_back(caplog):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = CodeClient(url, retries=6, backoff=0.25)
    servers = []

    async def main():
        task = asyncio.create_task(client.run("print(6 * 7)"))
        await asyncio.sleep(0.1)  # the first attempt has been refused
        servers.append(Server(port))
        return await task

    try:
        result = asyncio.run(main())
        assert servers[0].wait_ready() == url
    finally:
        for server in servers:
            server.stop()
    assert result["success"] is True and result["stdout"] == "42\n", result
    retries = [r.getMessage() for r in caplog.records if r.name == "rl2.tools.code_client"]
    assert retries and all("unreachable" in message and "retrying" in message for message in retries)
    assert client.faults.counts() == {"code_service_retries": len(retries)}


def test_client_with_nothing_listening():
    url = f"http://127.0.0.1:{free_port()}"
    client = CodeClient(url, retries=2, backoff=0.05)
    start = time.monotonic()
    results = asyncio.run(client.run_many(["print(1)", ("print(input())", "x")]))
    single = client.run_sync("print(1)")
    assert time.monotonic() - start < 3.0
    for result in results + [single]:
        assert result["success"] is False and result["reason"] == "internal_error"
        assert result["stderr"].startswith(f"code service at {url} unreachable")
        assert "gave up after 3 attempts" in result["stderr"]
    assert client.faults.counts() == {"code_service_retries": 2 + 2}  # run_many's one batch, then run_sync
    assert asyncio.run(client.ping()) is False


def test_client_argument_errors():
    with pytest.raises(ValueError, match="http"):
        CodeClient("localhost:8000")
    with pytest.raises(ValueError, match="concurrency"):
        CodeClient("http://localhost:8000", concurrency=0)
    with pytest.raises(TypeError, match="code string"):
        asyncio.run(CodeClient("http://localhost:8000").run_many([("print(1)",)]))


def test_server_exits_cleanly_when_port_taken(server):
    port = int(server.url.rsplit(":", 1)[1])
    second = Server(port)
    assert second.process.wait(timeout=30) == 1
    assert "cannot serve" in second.log() and "sandbox closed" not in second.log()
