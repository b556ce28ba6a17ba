"""A bounded pool of long-lived worker subprocesses that answer JSON requests, one at a time each.

Any worker may die at any moment (the OOM killer, a segfault, a kill). `WorkerPool.call` notices:
a worker found dead is restarted, a call whose worker dies under it is retried on a fresh worker
(at most `retries` times), a call past its deadline has its worker killed and replaced and raises
`WorkerTimeout`, and a call that still cannot complete raises `WorkerFailed`, naming the pool and
what happened. Every recovery is counted in the pool's `faults` (`<name>_restarts`,
`<name>_retries`, `<name>_timeouts`). A worker is also replaced after a response that asks for it
(`{"retire": why, ...}`: a worker that ran out of memory, counted in `<name>_restarts`) and after
`max_calls` calls (`<name>_recycles`, as gunicorn's max_requests: what leaks is let go).

Workers are started with `subprocess.Popen`, not multiprocessing, so the caller may be anything (a
notebook, `python -c`, a script on stdin, a `python -m` entry point). Protocol on the worker's
stdin/stdout: frames of a 4-byte big-endian length and a message encoded by the pool's codec (JSON
by default; `PICKLE` for Python objects between our own processes); the worker's first frame is
`{"ready": ...}`, then it answers each request with one frame. `serve(handle)` is the worker side.
A worker's stderr is passed on to ours line by line, and its last lines are kept: an error about a
worker that did not start or died quotes them (the missing module, the crash).

    with WorkerPool("echo", [[sys.executable, "-m", "my_worker"]] * 2) as pool:
        pool.call({"x": 1}, timeout=5.0)
"""

import asyncio
import collections
import json
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

from rl2.tools.faults import FaultCounter
from rl2.tools import process_tree
from rl2.tools.process_tree import PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, kill_tree

logger = logging.getLogger("rl2.tools.worker_pool")

# The guard needs the standard library alone: run isolated (-I) and without site (-S), it starts in ~15 ms
# and whatever the workers' environment (PYTHONPATH, the working directory) holds.
GUARD_COMMAND = [sys.executable, "-I", "-S", process_tree.__file__]
GUARD_GRACE = 2.0  # seconds a guard may take to clean up after its worker died and exit as it did
STDERR_LINES = 20  # how many of a worker's last stderr lines an error quotes


class Codec(Protocol):
    """How messages become frame bodies: `dumps(message) -> bytes`, `loads(bytes) -> message`."""

    def dumps(self, message: Any) -> bytes: ...

    def loads(self, body: bytes) -> Any: ...


class JsonCodec:
    """JSON objects (the default: language-neutral, and safe to read from any worker)."""

    def dumps(self, message: Any) -> bytes:
        return json.dumps(message).encode()

    def loads(self, body: bytes) -> Any:
        return json.loads(body)


JSON = JsonCodec()
PICKLE: Codec = pickle  # any picklable Python object; only between processes we started ourselves


class WorkerFailed(RuntimeError):
    """A call could not complete: its workers kept dying (or would not start), or the pool is closed.
    For the last worker that failed: `how` it failed and the `stderr_tail` it wrote last."""

    def __init__(self, message: str, how: str = "", stderr_tail: list[str] | None = None):
        super().__init__(message)
        self.how = how
        self.stderr_tail = list(stderr_tail or [])


class WorkerTimeout(WorkerFailed):
    """A call passed its deadline; its worker was killed and replaced."""


class _WorkerDied(Exception):
    """The worker of an attempt died, broke its pipe or did not start; the message says how."""


class _Deadline(Exception):
    """A read or write did not finish before its deadline."""


def exit_description(returncode: int) -> str:
    """How a process ended, from its `Popen.returncode`."""
    if returncode < 0:
        try:
            return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def child_python_environment() -> dict[str, str]:
    """Our environment, with our sys.path as PYTHONPATH: workers import the same rl2 (and the same
    packages) as we do, even when we found them through changes to sys.path rather than an install."""
    paths = [os.path.abspath(path) for path in sys.path]  # "" (the working directory) included
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def _wait_for(fd: int, events: int, deadline: float) -> None:
    """Wait until `fd` is ready for `events` (poll, not select: fds above 1024 are fine)."""
    poller = select.poll()
    poller.register(fd, events)
    if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
        raise _Deadline


class _Worker:
    """One worker process of a pool and its end of the protocol."""

    def __init__(self, command: list[str], codec: Codec, guarded: bool = False):
        self.command = command
        self.codec = codec
        self.process: subprocess.Popen | None = None
        self.guarded = guarded  # `process` is the worker's guard, the worker its child
        self.worker_pid: int | None = None  # a guarded worker's own pid, once it has started
        self.ready: dict | None = None  # the worker's {"ready": ...} frame, once read
        self.busy = False  # a request has been (or is being) sent and not yet answered
        self.calls = 0  # calls this process has answered
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        self._stderr_reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        """The worker's pid (its guard's until it has started)."""
        process = self.process
        return None if process is None else self.worker_pid or process.pid

    def alive(self) -> bool:
        process, worker_pid = self.process, self.worker_pid
        return (process is not None and process.poll() is None
                and (worker_pid is None or process_tree.running(worker_pid)))

    def start(self, spawn: Callable[[list[str]], subprocess.Popen]) -> None:
        self.process, self.ready, self.calls, self.worker_pid = spawn(self.command), None, 0, None
        os.set_blocking(self.process.stdin.fileno(), False)  # so a write can give up at its deadline
        self.stderr_tail = collections.deque(maxlen=STDERR_LINES)  # a fresh process, a fresh tail
        self._stderr_reader = threading.Thread(target=_pass_on_stderr, args=(self.process.stderr, self.stderr_tail),
                                               name=f"rl2-worker-{self.process.pid}-stderr", daemon=True)
        self._stderr_reader.start()

    def stderr_lines(self) -> Callable[[], list[str]]:
        """A function that gives this process's last non-empty stderr lines, still valid after the
        worker has been restarted."""
        reader, tail = self._stderr_reader, self.stderr_tail

        def lines() -> list[str]:
            if reader is not None:
                reader.join(timeout=1.0)  # the lines a dead worker wrote last may still be in the pipe
            return [line.strip() for line in tail if line.strip()]

        return lines

    def wait_ready(self, timeout: float) -> None:
        """Read the ready frame, unless already read."""
        if self.ready is not None:
            return
        try:
            hello = self._read(time.monotonic() + timeout)
        except _Deadline:
            raise _WorkerDied(f"did not start: no ready frame within {timeout:.0f} s") from None
        except (OSError, ValueError) as error:
            raise _WorkerDied(f"did not start: {type(error).__name__}: {error}") from None
        if not isinstance(hello, dict) or not hello.get("ready"):
            raise _WorkerDied("did not start" if hello is None else f"did not start: sent {hello!r}")
        self.ready = hello
        if self.guarded:
            self.worker_pid = next(iter(process_tree.children_by_parent().get(self.process.pid, [])), None)

    def exchange(self, request: dict, timeout: float) -> dict:
        """Send `request` and read the response, at most `timeout` seconds in all."""
        deadline = time.monotonic() + timeout
        body = self.codec.dumps(request)
        self.busy = True
        try:
            self._write(struct.pack(">I", len(body)) + body, deadline)
            response = self._read(deadline)
        except (OSError, ValueError) as error:  # a broken pipe, a malformed frame
            raise _WorkerDied(f"failed during the call ({type(error).__name__}: {error})") from None
        finally:
            self.busy = False
        if response is None:
            raise _WorkerDied("died during the call")
        return response

    def kill(self, died: bool = False) -> str:
        """Kill the worker's process group (and its guard), reap it and close its pipes; how it ended.
        `died`: the worker is known to have died (its guard is given a moment to end as the worker did)."""
        process, worker_pid = self.process, self.worker_pid
        self.process, self.ready, self.worker_pid = None, None, None
        if process is None:
            return "not running"
        if died and self.guarded:
            try:
                process.wait(timeout=GUARD_GRACE)
            except subprocess.TimeoutExpired:
                pass
        kill_tree(process.pid)
        returncode = process.wait()
        if worker_pid is not None:  # not our child, so not waited for: killed, it may still be freeing its memory
            deadline = time.monotonic() + 10.0
            while process_tree.running(worker_pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        process.stdin.close()
        process.stdout.close()
        return exit_description(returncode)

    def kill_reading_stderr(self) -> tuple[str, list[str]]:
        """`kill()` of a worker that died; how it ended and its last stderr lines."""
        lines = self.stderr_lines()
        return self.kill(died=True), lines()

    def _write(self, data: bytes, deadline: float) -> None:
        fd = self.process.stdin.fileno()
        while data:
            _wait_for(fd, select.POLLOUT, deadline)
            try:
                data = data[os.write(fd, data):]
            except BlockingIOError:
                pass

    def _read(self, deadline: float) -> dict | None:
        """The next frame; None at end of file."""
        header = self._read_exact(4, deadline)
        if header is None:
            return None
        body = self._read_exact(struct.unpack(">I", header)[0], deadline)
        return None if body is None else self.codec.loads(body)

    def _read_exact(self, n: int, deadline: float) -> bytes | None:
        chunks, fd = [], self.process.stdout.fileno()
        while n:
            _wait_for(fd, select.POLLIN, deadline)
            chunk = os.read(fd, n)
            if not chunk:
                return None
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)


class WorkerPool:
    """`len(commands)` worker processes, one per command (restarted with the same command), and a
    thread-safe `call` that waits for an idle one. `env`: the workers' whole environment (None:
    ours). `start_timeout`: seconds a worker may take to send its ready frame; start-up never counts
    against a call's timeout. `codec`: how requests and responses are encoded (the workers' `serve`
    must use the same). `max_calls`: calls a worker answers before it is replaced (0: no limit).
    `guarded`: each worker runs under a `rl2.tools.process_tree` guard, its parent, which kills what
    the worker left however it ended (pids are the workers' own). Workers end when the pool closes or
    this process dies."""

    def __init__(self, name: str, commands: list[list[str]], retries: int = 2, env: dict[str, str] | None = None,
                 start_timeout: float = 60.0, codec: Codec = JSON, max_calls: int = 0, guarded: bool = True):
        if not commands:
            raise ValueError(f"{name} worker pool needs at least one worker")
        if retries < 0:
            raise ValueError(f"{name} worker pool: retries must be >= 0, got {retries}")
        if max_calls < 0:
            raise ValueError(f"{name} worker pool: max_calls must be >= 0 (0 = no limit), got {max_calls}")
        self.name, self.retries, self.env, self.start_timeout = name, retries, env, float(start_timeout)
        self.max_calls = max_calls
        self.faults = FaultCounter()
        guard = GUARD_COMMAND if guarded and sys.platform.startswith("linux") else []
        self._workers = [_Worker([*guard, *command], codec, bool(guard)) for command in commands]
        self._idle = list(self._workers)
        self._closed = False
        self._lock = threading.Condition()  # guards _idle, _closed and every start and kill of a worker
        # PR_SET_PDEATHSIG fires when the *thread* that started a worker ends, not the process: start
        # every worker from this one long-lived thread, never from a caller's (maybe short-lived) one.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rl2-{name}-spawner")
        try:
            for worker in self._workers:
                worker.start(self._spawn)
            for worker in self._workers:
                self._start_up(worker)
        except BaseException:
            self.close()
            raise

    def call(self, request: dict, timeout: float) -> dict:
        """One worker's response to `request`. `timeout` counts from when the request is sent, not
        the wait for an idle worker or a worker's start-up. Raises `WorkerTimeout` past it and
        `WorkerFailed` when the call cannot complete."""
        worker = self._acquire()
        try:
            response = self._call_on(worker, request, timeout)
            self._retire_if_due(worker, response)
            return response
        finally:
            self._release(worker)

    async def call_async(self, request: dict, timeout: float) -> dict:
        """`call` without blocking the event loop."""
        return await asyncio.to_thread(self.call, request, timeout)

    def pids(self) -> list[int]:
        """The worker processes' pids."""
        with self._lock:
            return [pid for pid in (worker.pid for worker in self._workers) if pid is not None]

    def busy_pids(self) -> list[int]:
        """Pids of the workers handling a call now (its request sent or being sent)."""
        with self._lock:
            return [pid for pid in (worker.pid for worker in self._workers if worker.busy) if pid is not None]

    def ready_frames(self) -> list[dict]:
        """The `{"ready": ...}` frame of each worker that has sent one."""
        with self._lock:
            return [dict(worker.ready) for worker in self._workers if worker.ready is not None]

    def close(self) -> None:
        """Stop the workers. Calls in flight and later calls raise `WorkerFailed`."""
        with self._lock:
            self._closed = True
            for worker in self._idle:
                worker.kill()
            for worker in self._workers:  # the busy ones: their callers see them die, then stop them
                if (process := worker.process) is not None:
                    kill_tree(process.pid)
            self._idle = []
            self._lock.notify_all()
        self._spawner.shutdown(wait=False)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _call_on(self, worker: _Worker, request: dict, timeout: float) -> dict:
        failures = []
        for attempt in range(self.retries + 1):
            if attempt:
                self.faults.add(f"{self.name}_retries")
            try:
                if not worker.alive():
                    pid, (ended, _) = worker.pid, self._restart(worker, died=True)
                    logger.warning("%s worker pid %s was found dead (%s); restarted it", self.name, pid, ended)
                worker.wait_ready(self.start_timeout)
                return worker.exchange(request, timeout)
            except _Deadline:  # not retried: the request itself may be what takes too long
                pid = worker.pid
                self.faults.add(f"{self.name}_timeouts")
                self._restart(worker)
                logger.warning("%s worker pid %d gave no answer within %.1f s; killed and replaced",
                               self.name, pid, timeout)
                raise WorkerTimeout(f"{self.name} worker pid {pid} gave no answer within {timeout:.1f} s "
                                    "(killed and replaced)") from None
            except _WorkerDied as died:
                pid = worker.pid
                ended, stderr_tail = self._restart(worker, died=True)
                how = f"{died} ({ended})"
                failure = f"worker pid {pid} {died} ({ended}{_quote(stderr_tail)})"
                failures.append(failure)
                then = "retrying on a fresh worker" if attempt < self.retries else "giving up"
                logger.warning("%s %s; %s (attempt %d of %d)", self.name, failure, then, attempt + 1,
                               self.retries + 1)
        attempts = f"{len(failures)} attempt" + ("s" if len(failures) > 1 else "")
        raise WorkerFailed(f"{self.name} worker pool: the call failed ({attempts}): " + "; ".join(failures), how, stderr_tail)

    def _retire_if_due(self, worker: _Worker, response: Any) -> None:
        """Replace `worker` after a response that asks for it (counted as a restart) or its `max_calls`-th
        call (a recycle)."""
        worker.calls += 1
        why = response.get("retire") if isinstance(response, dict) else None
        if not why and not (self.max_calls and worker.calls >= self.max_calls):
            return
        pid = worker.pid
        try:
            self._restart(worker, counted="restarts" if why else "recycles")
        except WorkerFailed:  # closed meanwhile, or no new worker: the next call says so
            return
        if why:
            logger.warning("%s worker pid %s replaced: %s", self.name, pid, why)
        else:
            logger.info("%s worker pid %s replaced after %d calls", self.name, pid, self.max_calls)

    def _start_up(self, worker: _Worker) -> None:
        """Wait for a new worker's ready frame; one that dies first (killed, out of memory) is
        restarted up to `retries` times before the pool gives up."""
        for attempt in range(self.retries + 1):
            try:
                worker.wait_ready(self.start_timeout)
                return
            except _WorkerDied as error:
                pid = worker.pid
                if attempt == self.retries:
                    ended, stderr_tail = worker.kill_reading_stderr()
                    raise WorkerFailed(f"{self.name} worker pool: worker pid {pid} {error} ({ended}{_quote(stderr_tail)})",
                                       f"{error} ({ended})", stderr_tail) from None
                ended, stderr_tail = self._restart(worker, died=True)
                logger.warning("%s worker pid %s %s (%s%s); restarted it", self.name, pid, error, ended, _quote(stderr_tail))

    def _restart(self, worker: _Worker, died: bool = False, counted: str = "restarts") -> tuple[str, list[str]]:
        """Replace `worker`'s process with a fresh one (its ready frame is read later), counted in
        `<name>_<counted>`; how the old one ended, and (when it `died`) its last stderr lines."""
        with self._lock:
            lines = worker.stderr_lines()
            ended = worker.kill(died)
            if self._closed:
                raise WorkerFailed(f"{self.name} worker pool is closed")
            try:
                worker.start(self._spawn)
            except (OSError, RuntimeError) as error:  # RuntimeError: the interpreter is shutting down
                raise WorkerFailed(f"{self.name} worker pool: cannot start a worker: {error}") from None
            self.faults.add(f"{self.name}_{counted}")
        return ended, lines() if died else []

    def _spawn(self, command: list[str]) -> subprocess.Popen:
        return self._spawner.submit(
            subprocess.Popen, command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=self.env, bufsize=0, start_new_session=True,
        ).result()

    def _acquire(self) -> _Worker:
        with self._lock:
            while not self._idle and not self._closed:
                self._lock.wait()
            if self._closed:
                raise WorkerFailed(f"{self.name} worker pool is closed")
            return self._idle.pop(0)  # the longest idle: a worker that died idle is noticed soon

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)
                self._lock.notify()


def _quote(stderr_tail: list[str]) -> str:
    """`; its stderr ended: a | b` (empty when there are no lines)."""
    return "; its stderr ended: " + " | ".join(stderr_tail) if stderr_tail else ""


def _pass_on_stderr(pipe, tail: collections.deque) -> None:
    """Copy a worker's stderr to ours, line by line, keeping the last lines in `tail`, until it closes."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace")
            tail.append(line.rstrip("\n"))
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is closed (interpreter shutdown): keep draining
                pass


# ----------------------------------------------------------------------------------------------
# the worker side


def read_frame(fd: int, codec: Codec = JSON) -> Any:
    """The next frame from `fd` (blocking); None at end of file."""
    header = _read_exact(fd, 4)
    if header is None:
        return None
    body = _read_exact(fd, struct.unpack(">I", header)[0])
    return None if body is None else codec.loads(body)


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def write_frame(fd: int, message: Any, codec: Codec = JSON) -> None:
    body = codec.dumps(message)
    data = struct.pack(">I", len(body)) + body
    while data:
        data = data[os.write(fd, data):]


def serve(handle: Callable[[Any], Any], codec: Codec = JSON) -> None:
    """Run a worker: send the ready frame, then answer each request with `handle(request)` (or
    `{"error": "..."}` when it raises) until stdin closes. Call it in the worker's main thread, with
    the codec of its pool."""
    # End with the parent even while busy (end of file on stdin only reaches an idle worker).
    process_tree.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # Adopt orphaned descendants (a double-forked daemon) so the pool finds them in our tree and kills them
    # (when we die abruptly, our guard adopts them).
    process_tree.prctl(PR_SET_CHILD_SUBREAPER, 1)
    # Keep the protocol on private fds and point 0/1 elsewhere, so a stray print cannot corrupt a frame.
    requests, responses = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    write_frame(responses, {"ready": True, "pid": os.getpid()}, codec)
    try:
        while (request := read_frame(requests, codec)) is not None:
            try:
                response = handle(request)
            except Exception as error:
                response = {"error": f"{type(error).__name__}: {error}"}
            write_frame(responses, response, codec)
    finally:  # stdin closed, or the handler exited (sys.exit): what we started ends with us
        kill_tree(os.getpid(), itself=False)
