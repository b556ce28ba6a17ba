"""WorkerPool: calls, and recovery from workers that die (killed during a call, dead while idle,
stuck past a deadline, unable to start), with the faults it counts; workers end with their parent."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl2.tools.worker_pool import WorkerFailed, WorkerPool, WorkerTimeout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO}

# A test worker: waits `argv[1]` seconds before its ready frame; answers {"echo": x} with x and its
# pid, after waiting for the file {"wait_for": path} to exist; {"exit": code} exits; {"fail": m} raises;
# {"daemon": path} starts a daemon (fork, setsid, fork) that writes its pid to `path` and sleeps.
WORKER = """
import os, sys, time
from rl2.tools.worker_pool import serve

time.sleep(float(sys.argv[1]))

def start_daemon(path):
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            with open(path + ".part", "w") as note:
                note.write(str(os.getpid()))
            os.rename(path + ".part", path)
            time.sleep(600)
        os._exit(0)
    os.waitpid(child, 0)
    while not os.path.exists(path):
        time.sleep(0.01)
    return {"daemon": int(open(path).read()), "pid": os.getpid()}

def handle(request):
    if "daemon" in request:
        return start_daemon(request["daemon"])
    if "exit" in request:
        os._exit(request["exit"])
    if "fail" in request:
        raise ValueError(request["fail"])
    if "retire" in request:
        return {"pid": os.getpid(), "retire": request["retire"]}
    while not os.path.exists(request.get("wait_for", "/")):
        time.sleep(0.01)
    return {"echo": request.get("echo"), "pid": os.getpid()}

serve(handle)
"""


def make_pool(workers: int = 1, retries: int = 2, start_delay: float = 0.0, max_calls: int = 0) -> WorkerPool:
    return WorkerPool("test", [[sys.executable, "-c", WORKER, str(start_delay)]] * workers, retries=retries, env=ENV,
                      max_calls=max_calls)


def is_gone(pid: int) -> bool:
    """Whether `pid` has exited (absent, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def wait_gone(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not all(map(is_gone, pids)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_busy(pool: WorkerPool, timeout: float = 30.0) -> int:
    """The pid of a worker handling a call, once there is one."""
    deadline = time.monotonic() + timeout
    while not (busy := pool.busy_pids()):
        assert time.monotonic() < deadline, "no call in flight"
        time.sleep(0.01)
    return busy[0]


def test_calls_are_answered_concurrently_and_errors_come_back():
    with make_pool(workers=2) as pool:
        assert sorted(frame["pid"] for frame in pool.ready_frames()) == sorted(pool.pids())
        with ThreadPoolExecutor(max_workers=4) as threads:
            responses = list(threads.map(lambda i: pool.call({"echo": i}, timeout=30.0), range(8)))
        assert [r["echo"] for r in responses] == list(range(8))
        assert {r["pid"] for r in responses} <= set(pool.pids())
        assert pool.call({"fail": "bad input"}, timeout=30.0) == {"error": "ValueError: bad input"}
        assert pool.call({"echo": "after"}, timeout=30.0)["echo"] == "after"
        assert asyncio.run(pool.call_async({"echo": "async"}, timeout=30.0))["echo"] == "async"
        assert pool.faults.counts() == {}


def test_a_worker_killed_during_a_call_is_replaced_and_the_call_retried(tmp_path):
    release = tmp_path / "release"
    with make_pool() as pool, ThreadPoolExecutor(max_workers=1) as thread:
        call = thread.submit(pool.call, {"echo": "x", "wait_for": str(release)}, 60.0)
        killed = wait_busy(pool)
        os.kill(killed, signal.SIGKILL)
        release.touch()  # the retried call can finish now
        response = call.result(timeout=60)
        assert response["echo"] == "x" and response["pid"] != killed
        assert pool.pids() == [response["pid"]]
        assert pool.faults.counts() == {"test_restarts": 1, "test_retries": 1}


def test_a_worker_found_dead_is_restarted_and_its_start_up_is_not_counted_against_the_call():
    with make_pool(start_delay=2.0) as pool:
        [dead] = pool.pids()
        os.kill(dead, signal.SIGKILL)
        assert wait_gone([dead])
        # The replacement takes 2 s to start; the call's 1 s counts only after that.
        response = pool.call({"echo": 1}, timeout=1.0)
        assert response["echo"] == 1 and response["pid"] != dead
        assert pool.faults.counts() == {"test_restarts": 1}


def test_a_call_past_its_deadline_raises_and_its_worker_is_replaced(tmp_path):
    with make_pool() as pool:
        [stuck] = pool.pids()
        start = time.monotonic()
        with pytest.raises(WorkerTimeout, match=rf"test worker pid {stuck} gave no answer within 0.5 s"):
            pool.call({"wait_for": str(tmp_path / "never")}, timeout=0.5)
        assert time.monotonic() - start < 10.0
        assert is_gone(stuck) and stuck not in pool.pids()
        assert pool.faults.counts() == {"test_timeouts": 1, "test_restarts": 1}
        assert pool.call({"echo": 2}, timeout=30.0)["pid"] not in (stuck, None)
        assert pool.faults.counts() == {"test_timeouts": 1, "test_restarts": 1}
    assert issubclass(WorkerTimeout, WorkerFailed)


def test_a_call_whose_workers_keep_dying_fails_with_what_happened():
    with make_pool(retries=2) as pool:
        with pytest.raises(WorkerFailed, match=r"test worker pool: the call failed \(3 attempts\): worker pid \d+ died "
                                               r"during the call \(exited with code 3\); "):
            pool.call({"exit": 3}, timeout=30.0)
        # One retry per failure but the last; each dead worker replaced, the last one too.
        assert pool.faults.counts() == {"test_retries": 2, "test_restarts": 3}
        assert pool.call({"echo": 3}, timeout=30.0)["echo"] == 3
        assert pool.faults.counts() == {"test_retries": 2, "test_restarts": 3}


def test_a_worker_killed_while_starting_is_restarted(tmp_path):
    """The first process of each worker is SIGKILLed before its ready frame (as the OOM killer or a
    chaos test might); the pool starts anyway, on replacements, and counts the restarts."""
    dies_first = ("import os, signal, sys\nif not os.path.exists(sys.argv[2]):  # this worker's first process\n"
                  "    open(sys.argv[2], 'w').close()\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    commands = [[sys.executable, "-c", dies_first + WORKER, "0", str(tmp_path / f"started{i}")] for i in range(3)]
    with WorkerPool("test", commands[:2], retries=1, env=ENV) as pool:
        assert pool.call({"echo": 1}, timeout=30.0)["echo"] == 1
        assert pool.faults.counts() == {"test_restarts": 2}
    with pytest.raises(WorkerFailed, match=r"test worker pool: worker pid \d+ did not start \(killed by signal 9"):
        WorkerPool("test", commands[2:], retries=0, env=ENV)


def test_a_worker_that_cannot_start():
    with pytest.raises(WorkerFailed, match=r"broken worker pool: worker pid \d+ did not start \(exited with code 7\)"):
        WorkerPool("broken", [[sys.executable, "-c", "import sys; sys.exit(7)"]])
    with pytest.raises(ValueError, match="at least one worker"):
        WorkerPool("empty", [])


def test_close_stops_the_workers_and_fails_calls_in_flight_and_later(tmp_path):
    pool = make_pool(workers=2)
    pids = pool.pids()
    with ThreadPoolExecutor(max_workers=1) as thread:
        call = thread.submit(pool.call, {"wait_for": str(tmp_path / "never")}, 60.0)
        wait_busy(pool)
        pool.close()
        with pytest.raises(WorkerFailed, match="closed"):
            call.result(timeout=60)
    assert wait_gone(pids) and pool.pids() == []
    with pytest.raises(WorkerFailed, match="test worker pool is closed"):
        pool.call({"echo": 4}, timeout=30.0)
    assert pool.faults.counts() == {}


def test_a_worker_restarted_from_a_short_lived_thread_outlives_the_thread():
    """The parent-death signal follows the thread that started a worker: a replacement started in
    a caller's thread would die with that thread."""
    with make_pool() as pool:
        [dead] = pool.pids()
        os.kill(dead, signal.SIGKILL)
        assert wait_gone([dead])
        caller = threading.Thread(target=pool.call, args=({"echo": 5}, 30.0))
        caller.start()
        caller.join()
        [fresh] = pool.pids()
        time.sleep(0.5)
        assert not is_gone(fresh)
        assert pool.call({"echo": 6}, timeout=30.0)["pid"] == fresh
        assert pool.faults.counts() == {"test_restarts": 1}


def test_workers_end_with_their_parent(tmp_path):
    """A parent that ends without closing its pool (os._exit, a kill) leaves no workers, idle or busy."""
    parent = (
        "import os, sys, threading, time\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_worker_pool import make_pool, wait_busy\n"
        "pool = make_pool(workers=2)\n"
        f"threading.Thread(target=pool.call, args=({{'wait_for': {str(tmp_path / 'never')!r}}}, 60.0)).start()\n"
        "busy = wait_busy(pool)\n"
        "print(busy, *[pid for pid in pool.pids() if pid != busy], flush=True)\n"
        "os._exit(0)\n"
    )
    with open(tmp_path / "stderr", "w+") as stderr:  # a file: surviving workers would hold a pipe open
        out = subprocess.run([sys.executable, "-c", parent], stdout=subprocess.PIPE, stderr=stderr, text=True,
                             timeout=120, env=ENV)
        stderr.seek(0)
        assert out.returncode == 0, stderr.read()
    pids = [int(pid) for pid in out.stdout.split()]
    assert len(pids) == 2
    assert wait_gone(pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper is Linux's")
@pytest.mark.parametrize("end", ["os._exit(0)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_a_workers_daemon_ends_when_the_pools_process_dies(tmp_path, end):
    """The pool's process dies abruptly: each worker's guard (parent-death signal SIGTERM) kills the
    worker and the daemon it started, which had left the worker's process group and been orphaned."""
    parent = (
        "import os, signal, sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_worker_pool import make_pool\n"
        "pool = make_pool()\n"
        f"started = pool.call({{'daemon': {str(tmp_path / 'daemon.pid')!r}}}, 60.0)\n"
        "print(started['daemon'], started['pid'], flush=True)\n"
        f"{end}\n"
    )
    with open(tmp_path / "stderr", "w+") as stderr:  # a file: surviving processes would hold a pipe open
        out = subprocess.run([sys.executable, "-c", parent], stdout=subprocess.PIPE, stderr=stderr, text=True,
                             timeout=120, env=ENV)
        stderr.seek(0)
        assert out.returncode in (0, -signal.SIGKILL), stderr.read()
    daemon, worker = (int(pid) for pid in out.stdout.split())
    try:
        assert wait_gone([worker, daemon]), f"left running: {[pid for pid in (worker, daemon) if not is_gone(pid)]}"
    finally:
        for pid in (worker, daemon):
            if not is_gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_worker_is_replaced_when_it_asks_and_after_max_calls():
    """A response with "retire" (a worker out of memory) replaces its worker, counted as a restart; the
    `max_calls`-th call of a worker replaces it too, counted as a recycle."""
    with make_pool(max_calls=3) as pool:
        first = pool.call({"retire": "out of memory"}, timeout=10)["pid"]
        pids = [pool.call({"echo": i}, timeout=10)["pid"] for i in range(4)]
        faults = pool.faults.counts()
    assert first not in pids and pids[0] == pids[1] == pids[2] != pids[3]
    assert faults == {"test_restarts": 1, "test_recycles": 1}
