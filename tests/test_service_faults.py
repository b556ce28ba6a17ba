"""Services that die during a run: `recipes/lib.sh`'s `start_service` restarts the code service and
the retrieval service (same command, same port) after a SIGKILL, the clients ride the restart out by
retrying the call in flight and count it (`code_service_retries`, `search_retries`), the counts reach
`Env.fault_counts()`, and a service that keeps dying (or never starts) stops the script."""

import asyncio
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import time

from retrieval_helpers import SAMPLE_CORPUS
from server_process import REPO, python_env
from rl2.rollout.env import Env
from rl2.tools.code_client import CodeClient
from rl2.tools.faults import FaultCounter
from rl2.tools.search_client import retrieve

START_TIMEOUT = 120  # seconds for a service to be ready (generous: the machine may be loaded)
# Retries the clients get here: 55.5 s of backoff rather than the default 23.5 s (which a restart takes a
# few seconds of), so that a slow restart on a loaded machine does not fail the test.
RETRIES = 10


def session_processes(session: int) -> dict[int, list[str]]:
    """pid -> argv of the live processes in `session`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")[:-1]
        except OSError:  # it ended meanwhile
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            found[int(entry)] = argv
    return found


class Supervised:
    """`start_service NAME LOG READY COMMAND...` run by bash in a session of its own; the script
    then prints SERVICE_URL and waits for its stdin to close (then exits, stopping the service)."""

    def __init__(self, tmp_path, name: str, ready: str, command: list[str], **env: str):
        self.log = str(tmp_path / f"{name.replace(' ', '_')}.log")
        self.out, self.err = str(tmp_path / "script.out"), str(tmp_path / "script.err")
        start = shlex.join(["start_service", name, self.log, ready, *command])
        script = (f"set -euo pipefail\nsource recipes/lib.sh\n{start}\n"
                  'echo "SERVICE_URL=$SERVICE_URL"\nread -r _ || true\necho "script done"\n')
        with open(self.out, "w") as out, open(self.err, "w") as err:  # files, not pipes: nothing can hang on them
            self.process = subprocess.Popen(["bash", "-c", script], stdin=subprocess.PIPE, stdout=out, stderr=err,
                                            cwd=REPO, env={**python_env(), **env}, start_new_session=True)

    def output(self) -> str:
        return open(self.out).read()

    def errors(self) -> str:
        return open(self.err).read()

    def service_log(self) -> str:
        return open(self.log).read() if os.path.exists(self.log) else ""

    def wait_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            match = re.search(r"SERVICE_URL=(\S+)", self.output())
            if match:
                return match.group(1)
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no SERVICE_URL:\n{self.errors()}\n{self.service_log()}")

    def service_pid(self, module: str) -> int:
        (pid,) = [pid for pid, argv in session_processes(self.process.pid).items() if argv[1:3] == ["-m", module]]
        return pid

    def wait_restarted(self, module: str, old_pid: int) -> int:
        """The pid of the restarted service, once it runs."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            pids = [pid for pid, argv in session_processes(self.process.pid).items()
                    if argv[1:3] == ["-m", module] and pid != old_pid]
            if pids:
                return pids[0]
            time.sleep(0.1)
        raise AssertionError(f"{module} was not restarted:\n{self.service_log()}")

    def stop(self) -> int:
        """Let the script end (its EXIT trap stops the service); its exit status."""
        self.process.stdin.close()
        return self.process.wait(timeout=60)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@contextlib.contextmanager
def supervised(tmp_path, name: str, ready: str, command: list[str], **env: str):
    script = Supervised(tmp_path, name, ready, command, **env)
    try:
        yield script
    finally:
        script.kill()


def assert_stopped_cleanly(script: Supervised) -> None:
    """The script ends when its stdin closes and leaves no process of its session behind."""
    assert script.stop() == 0, script.errors()
    assert "script done" in script.output()
    deadline = time.monotonic() + 30
    while session_processes(script.process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_processes(script.process.pid) == {}


def restart_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("[start_service]")]


def test_code_service_killed_while_a_call_runs_is_restarted_and_the_call_retried(tmp_path, monkeypatch):
    module = "rl2.tools.code_server"
    command = ["python", "-m", module, "--host", "127.0.0.1", "--port", "0", "--workers", "2", "--timeout", "20"]
    with supervised(tmp_path, "code server", "code service ready at", command) as script:
        url = script.wait_url()
        first = script.service_pid(module)
        client = CodeClient(url, retries=RETRIES)

        async def call_while_killed():
            task = asyncio.create_task(client.run("import time\ntime.sleep(2)\nprint(6 * 7)"))
            await asyncio.sleep(0.5)  # the request is in flight, or about to be
            os.kill(first, signal.SIGKILL)
            return await task

        result = asyncio.run(call_while_killed())
        assert result["success"] is True and result["stdout"] == "42\n", result
        retries = client.faults.counts()["code_service_retries"]
        assert 1 <= retries <= RETRIES
        second = script.wait_restarted(module, first)
        (line,) = restart_lines(script.service_log())
        assert f"the code server at {url} died (status 137); restarting it (1/5)" in line
        assert "--port " + url.rsplit(":", 1)[1] in line  # same port, though the command said 0
        assert "restarting it (1/5)" in script.errors()
        assert script.service_log().count(f"code service ready at {url}") == 2

        # Through the env file, as the trainer calls it: the client lives in the module's Lazy.
        monkeypatch.setenv("CODE_SERVER_URL", url)
        monkeypatch.setenv("CODE_SERVER_RETRIES", str(RETRIES))
        with Env(os.path.join(REPO, "envs", "python_tool.py"), timeout=120, need_interact=True) as env:
            os.kill(second, signal.SIGKILL)
            (reply,) = env.interact([[{"role": "assistant", "content": '<tool_call>{"name": "python", "arguments": '
                                                                       '{"code": "print(2 ** 10)"}}</tool_call>'}]])
            assert reply.error is None and reply.value == [{"role": "tool", "content": "1024"}]
            counts = env.fault_counts()
        assert set(counts) == {"code_service_retries"} and counts["code_service_retries"] >= 1
        assert len(restart_lines(script.service_log())) == 2
        assert_stopped_cleanly(script)


def test_retrieval_service_killed_is_restarted_and_searches_retried(tmp_path, monkeypatch):
    module = "rl2.tools.retrieval_server"
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(SAMPLE_CORPUS, corpus)
    command = ["python", "-m", module, "--corpus", str(corpus), "--host", "127.0.0.1", "--port", "0"]
    with supervised(tmp_path, "retrieval server", "retrieval server ready on", command) as script:
        url = script.wait_url() + "/retrieve"
        first = script.service_pid(module)
        faults = FaultCounter()
        os.kill(first, signal.SIGKILL)  # just before the call: it finds the service gone
        hits = asyncio.run(retrieve(["Night Watch painter"], url, retries=RETRIES, faults=faults))
        assert hits[0][0]["document"]["contents"].startswith("The Night Watch\n")
        assert 1 <= faults.counts()["search_retries"] <= RETRIES
        second = script.wait_restarted(module, first)
        assert "restarting it (1/5)" in restart_lines(script.service_log())[0]

        monkeypatch.setenv("SEARCH_URL", url)
        monkeypatch.setenv("SEARCH_RETRIES", str(RETRIES))
        with Env(os.path.join(REPO, "envs", "search.py"), timeout=120, need_interact=True) as env:
            os.kill(second, signal.SIGKILL)
            (reply,) = env.interact([[{"role": "assistant", "content": "<search>Night Watch painter</search>"}]])
            assert reply.error is None
            assert reply.value[0]["content"].startswith("<information>Doc 1(Title: The Night Watch)")
            counts = env.fault_counts()
        assert set(counts) == {"search_retries"} and counts["search_retries"] >= 1
        assert len(restart_lines(script.service_log())) == 2
        assert_stopped_cleanly(script)


# A stand-in service: ready at once on its --port (45678 for 0), then it dies with status 3.
DYING = ["bash", "-c", 'p=$2; [ "$p" = 0 ] && p=45678; echo "fake ready at http://127.0.0.1:$p (args: $*)"; '
         "sleep 0.3; exit 3", "fake", "--port", "0"]


def test_a_service_that_keeps_dying_stops_the_script(tmp_path):
    with supervised(tmp_path, "fake service", "fake ready at", DYING, SERVICE_RESTARTS="2") as script:
        assert script.wait_url() == "http://127.0.0.1:45678"
        assert script.process.wait(timeout=60) != 0  # stopped by the supervisor, not by its stdin
        assert "script done" not in script.output()
        log = script.service_log()
        assert [line.split(": ", 1)[0] for line in restart_lines(log)] == [
            "[start_service] the fake service at http://127.0.0.1:45678 died (status 3); restarting it (1/2)",
            "[start_service] the fake service at http://127.0.0.1:45678 died (status 3); restarting it (2/2)"]
        started_with = re.findall(r"^fake ready at .* \(args: (.*)\)$", log, re.MULTILINE)
        assert started_with == ["--port 0", "--port 45678", "--port 45678"]  # restarted on the port it bound
        assert "died (status 3) after 2 restarts in a row; stopping" in script.errors()


def test_a_service_that_never_starts_stops_the_script(tmp_path):
    command = ["bash", "-c", "echo 'cannot load the index'; exit 2"]
    with supervised(tmp_path, "fake service", "fake ready at", command) as script:
        assert script.process.wait(timeout=60) == 1
        assert "SERVICE_URL" not in script.output()
        assert "cannot load the index" in script.errors() and "the fake service did not start" in script.errors()
        assert restart_lines(script.service_log()) == []


def test_default_retries_ride_out_a_restart_and_are_bounded():
    """The documented budget, 23.5 s of backoff in all for both clients: longer than a restart takes
    (a few seconds), short enough to fit in an env call's timeout (60 s by default)."""
    import inspect

    client = CodeClient("http://127.0.0.1:1")
    waits = [min(client.backoff * 2 ** i, client.max_backoff) for i in range(client.retries)]
    assert waits == [0.5, 1, 2, 4, 8, 8] and sum(waits) == 23.5
    defaults = {name: p.default for name, p in inspect.signature(retrieve).parameters.items()}
    waits = [min(defaults["backoff"] * 2 ** i, defaults["max_backoff"]) for i in range(defaults["retries"])]
    assert sum(waits) == 23.5


def test_env_files_keep_their_fault_counters_at_module_level(monkeypatch):
    """The search env's module-level FaultCounter and the code tool's Lazy client are what
    `Env.fault_counts()` reads: nothing before a call, then what they counted."""
    with Env(os.path.join(REPO, "envs", "search.py"), need_interact=True) as env:
        assert env.fault_counts() == {}
        env._module.faults.add("search_retries", 2)
        assert env.fault_counts() == {"search_retries": 2}
    monkeypatch.setenv("CODE_SERVER_URL", "http://127.0.0.1:1")
    with Env(os.path.join(REPO, "envs", "python_tool.py"), need_interact=True) as env:
        assert env.fault_counts() == {}  # the client is made at the first call
        env._module._code_client.get().faults.add("code_service_retries", 3)
        assert env.fault_counts() == {"code_service_retries": 3}
