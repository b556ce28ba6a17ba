"""Rank processes for the tests' distributed runs, forked from a server that imported torch,
transformers and rl2 once.

On this 2-core machine a `torchrun --nproc_per_node=2` launch spends ~20 CPU-seconds before the
first line of a test's work: ~3 in torchrun's own process and ~8 in each rank importing the same
modules. Most distributed tests do a second or two of work after that, so launches were most of the
suite's time. `launch` starts the ranks from a `multiprocessing` forkserver that has preloaded those
modules and gives each rank what
torchrun gives it: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
an environment of the caller's choosing, `python -m module` or `python script.py` semantics for
`__main__` and `sys.argv`, every rank's output on one stdout and one stderr, and the other ranks
stopped (SIGTERM, as torchrun does) when one fails. The recipe and demo tests still launch through the real torchrun.

Forking is safe only from a single-threaded process: a thread running in the server when it forks
leaves the child with that thread's locks held and its state half-updated. The server imports, and
never runs a torch op, so torch and transformers start no thread; but pyarrow (imported by
`datasets`) starts its bundled jemalloc's background thread at import, which forked ranks inherited
in an inconsistent state (the one crash seen: a segfault in a forked rank). The server therefore
starts with that thread switched off (`JE_ARROW_MALLOC_CONF`), and `server_threads` lets a test check
that it has no other.
"""

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time

from rl2.launch import EXPLAINED_EXIT_CODES
from server_process import free_port

PRELOAD = ["torch", "torch.distributed.fsdp", "transformers", "datasets", "rl2.trainer.ppo", "rl2.trainer.sft",
           "rl2.trainer.rm", "rl2.trainer.dpo", "rl2.trainer.difficulty_filter"]
STOP_GRACE = 5.0  # seconds the other ranks get to end on SIGTERM after one failed, before they are killed


# The environment the forkserver starts with (it inherits the caller's): arrow's jemalloc without
# its background thread, so that the server stays single-threaded.
SERVER_ENVIRONMENT = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}


def _context() -> multiprocessing.context.BaseContext:
    for key, value in SERVER_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _server_pid() -> int:
    return os.getppid()


def server_threads() -> list[str]:
    """The names of the forkserver's threads (it is started if it is not running yet)."""
    with _context().Pool(1) as pool:
        pid = pool.apply(_server_pid)
    return [open(f"/proc/{pid}/task/{task}/comm").read().strip() for task in os.listdir(f"/proc/{pid}/task")]


def _run_rank(target: list[str], env: dict[str, str], cwd: str, stdout_path: str, stderr_path: str) -> None:
    """In the forked rank: take the environment, output files and argv, then run `target` as __main__."""
    os.setsid()  # its own group: the launcher kills everything a rank started
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        out = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(out, fd)
        os.close(out)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.stdin = open(os.devnull)
    tempfile.tempdir = None  # read TMPDIR again
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = extra
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        sys.modules.pop(target[1], None)  # run fresh as __main__, as `python -m` does (preloaded here)
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    elif target[0] == "-c":
        sys.argv = ["-c", *target[2:]]
        exec(compile(target[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(target)
        sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
        runpy.run_path(target[0], run_name="__main__")


def launch(target: list[str], nproc: int, env: dict[str, str], cwd: str, timeout: float,
           distributed: bool = True) -> subprocess.CompletedProcess:
    """Run `target` (["-m", module, *args], ["-c", code, *args] or [script, *args]) on `nproc` ranks;
    the ranks' combined output and the first failing rank's exit status (0 when all succeeded).
    `distributed=False` (one process): no torchrun variables, as under plain `python`."""
    context = _context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rl2-ranks-") as folder:
        stdout_path, stderr_path = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for path in (stdout_path, stderr_path):
            open(path, "w").close()
        ranks = []
        for rank in range(nproc):
            rank_env = dict(env)
            if distributed:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                                GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            process = context.Process(target=_run_rank, args=(target, rank_env, cwd, stdout_path, stderr_path))
            process.start()
            ranks.append(process)
        first_failed = _wait(ranks, timeout)
        with open(stdout_path) as out, open(stderr_path) as err:
            stdout, stderr = out.read(), err.read()
    codes = [process.exitcode for process in ranks]
    if first_failed is not None and distributed and codes[first_failed] not in EXPLAINED_EXIT_CODES:
        stderr += rank_summary(first_failed, codes)  # as `rl2run`: torchrun's report, unless rl2 said why
    if first_failed is None and any(code != 0 for code in codes):
        raise subprocess.TimeoutExpired(target, timeout, stdout, stderr + rank_summary(None, codes))
    return subprocess.CompletedProcess(target, 0 if first_failed is None else codes[first_failed], stdout, stderr)


def rank_summary(first_failed: int | None, exit_codes: list[int | None]) -> str:
    """A line naming the rank that failed first (None: none had failed) and how each rank ended."""
    ends = ", ".join(f"rank {rank}: {_ending(code)}" for rank, code in enumerate(exit_codes))
    head = "no rank had failed" if first_failed is None else f"rank {first_failed} failed first"
    return f"\nrank_launcher: {head} ({ends})\n"


def _ending(exit_code: int | None) -> str:
    if exit_code is None:
        return "still running"
    if exit_code < 0:
        return f"killed by {signal.Signals(-exit_code).name}"
    return f"exit code {exit_code}"


def _wait(ranks: list, timeout: float) -> int | None:
    """The rank that failed first (a non-zero exit status; None if none did), once every rank has
    ended; after a failure the others get STOP_GRACE seconds. On timeout a rank may still be running
    when it returns. Every rank's process group is killed before returning."""
    deadline = time.monotonic() + timeout
    failed: int | None = None
    try:
        while True:
            codes = [process.exitcode for process in ranks]
            if failed is None:
                failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
                if failed is not None:  # as torchrun does: the others are stopped at once
                    deadline = min(deadline, time.monotonic() + STOP_GRACE)
                    for process, code in zip(ranks, codes):
                        if code is None:
                            _signal_group(process.pid, signal.SIGTERM)
            if all(code is not None for code in codes) or time.monotonic() > deadline:
                return failed
            time.sleep(0.02)
    finally:
        for process in ranks:
            _signal_group(process.pid, signal.SIGKILL)
            process.join()


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal a rank and its process group: a rank that has not made its group yet (it was still starting
    when another failed) gets the signal too."""
    for send in (os.kill, os.killpg):
        try:
            send(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
