"""What a process started, found and killed: `descendants`, `kill_tree`, and the guard that a worker pool
puts between itself and each worker it starts (`python -m rl2.tools.process_tree COMMAND...`).

A worker that ends on its own kills what it started (`rl2.tools.worker_pool.serve`), but one that dies
abruptly (SIGKILL from the OOM killer, a segfault, `os._exit`) cannot: its orphans — a daemon a reward
function started with a double fork and `setsid`, out of its process group — would be re-parented to
init and live on. The guard is their child subreaper instead: it runs the worker as its child, waits for
it to end however it ends, kills and reaps every process left below it, and exits as the worker did
(the same code, or killed by the same signal), so the pool sees the worker's own end. If the pool's
process dies, the guard gets SIGTERM (its parent-death signal) and does the same.
"""

import ctypes
import os
import resource
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def children_by_parent() -> dict[int, list[int]]:
    """Every process's children now, by parent pid (from /proc; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])  # after "(name)": state, ppid
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """The pids of `pid`'s descendants now."""
    children = children_by_parent()
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def kill_tree(pid: int, itself: bool = True) -> None:
    """SIGKILL every descendant of process `pid` (stopped first, so none forks a new one meanwhile; a
    worker and its guard are their descendants' subreapers, so daemons stay in the tree) and, with
    `itself`, `pid` and its process group."""
    stopped: set[int] = set()
    while new := [p for p in [*([pid] if itself else []), *descendants(pid)] if p not in stopped]:
        for process in new:
            _signal(process, signal.SIGSTOP)
        stopped.update(new)
    if itself:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for process in stopped:
        _signal(process, signal.SIGKILL)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def prctl(option: int, value: int) -> None:
    """Linux's prctl(2) with one argument (nothing elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def reap_all() -> None:
    """Wait for every child (the worker's orphans re-parented to us, once killed)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def end_like(status: int) -> None:
    """Exit as a process whose wait status is `status` did: killed by its signal, or with its code."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a worker's segfault, not ours: no core file
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose action cannot be set
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def guard(command: list[str]) -> None:
    """Run `command` as our child, then kill what it left and end as it ended (never returns)."""
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the pool's process died before we set the death signal
        os._exit(1)

    def pool_gone(signum: int, frame) -> None:
        kill_tree(os.getpid(), itself=False)
        reap_all()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, pool_gone)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole session; the pool decides
    worker = os.fork()
    if worker == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            os.execvp(command[0], command)
        except OSError as error:
            os.write(2, f"rl2 worker guard: cannot run {command[0]}: {error}\n".encode())
            os._exit(127)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the pipes are the worker's alone: its end is seen as end of file at once
        os.dup2(devnull, fd)
    while True:
        try:
            _, status = os.waitpid(worker, 0)
            break
        except InterruptedError:
            continue
    kill_tree(os.getpid(), itself=False)
    reap_all()
    end_like(status)


if __name__ == "__main__":
    guard(sys.argv[1:])
