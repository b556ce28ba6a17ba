"""A warm executor for untrusted Python: the process `rl2.tools.sandbox.Sandbox` starts (inside
bubblewrap where available) and sends programs to, one at a time.

Starting a fresh interpreter costs ~11 ms; forking this already-started one costs well under one.
For each program the worker forks a child that puts itself in a new session, takes its stdin and
output files, sets resource limits, drops to the worker's own unprivileged uid (when the worker
runs as root), arranges to die with the worker, enters a fresh temporary directory and executes the
code. The worker waits with a wall-clock deadline, then kills everything the program left behind: it
is a child subreaper, so every orphaned descendant is re-parented to it and found by scanning /proc;
then (with a uid of its own) every process of that uid, wherever it is.

Standalone on purpose (no rl2 imports): it runs under `python -I` with a scrubbed environment.
Protocol on fds 0/1: frames of a 4-byte big-endian length and a JSON object; the first frame the
worker sends is {"ready": ...}; each request gets one response. Started with {"kill_uids": [...]}
instead of a worker's settings, it kills every process of those uids and exits.
"""

import builtins
import codecs
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWNET = 0x40000000
SETUP_FAILED = 125  # the child's exit status when it could not set itself up (never user code)
CUT_POLL = 0.001  # seconds: the shortest wait between looks at a running program (near its deadline)
ORPHAN_POLL = 0.01  # seconds between looks for the end of processes a program left running


def read_frame(fd: int) -> dict | None:
    header = read_exact(fd, 4)
    if header is None:
        return None
    body = read_exact(fd, struct.unpack(">I", header)[0])
    return None if body is None else json.loads(body)


def read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def write_frame(fd: int, message: dict) -> None:
    body = json.dumps(message).encode()
    data = struct.pack(">I", len(body)) + body
    while data:
        data = data[os.write(fd, data):]


def prctl(option: int, value: int) -> int:
    return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (zombies included), from /proc."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses, so split after the last ")"
        if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
            found.append(int(name))
    return found


def kill_group(pgid: int) -> None:
    # One signal reaches a whole process group, including members forked while it is delivered,
    # so a fork bomb that stayed in its group dies at once.
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_descendants() -> None:
    """Kill and reap every process below this one. Orphans re-parent to us (we are a subreaper),
    so repeating until we have no children leaves none anywhere below."""
    me, own_group = os.getpid(), os.getpgid(0)
    while True:
        pids = children_of(me)
        if not pids:
            return
        for pid in pids:
            try:
                group = os.getpgid(pid)
                if group != own_group:
                    kill_group(group)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def kill_uid(uid: int) -> None:
    """Kill every process of `uid` that we can see (ours in the namespace; the host's under the uid
    fallback): what a program left outside our process tree, e.g. a daemon of a program whose previous
    worker was killed mid-run. The uid is this worker's alone (`rl2.tools.sandbox.UidClaims`)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)  # every process this uid may signal, but this one
        except BaseException:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


def flushing_exit(status: int, _exit=os._exit) -> None:
    """`os._exit` for the program: flush its output first (the real one would drop what is buffered)."""
    flush_output()
    _exit(status)


def confine(limits: dict, run_dir: str, fds: tuple[int, int, int], uid: int | None, worker_pid: int) -> None:
    """In a forked child: take the program's files, session, limits, uid, directory and environment."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, 65536)
    mb = 1024 * 1024
    cpu = max(1, int(limits["timeout"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    # Die with the worker (killed from outside mid-run); set after setuid, which clears it.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != worker_pid:
        os._exit(SETUP_FAILED)
    os.chdir(run_dir)
    os.environ.clear()
    os.environ.update(
        PATH="/usr/local/bin:/usr/bin:/bin", HOME=run_dir, TMPDIR=run_dir, LANG="C.UTF-8",
        OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
    )
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)


def run_child(program: dict, limits: dict, run_dir: str, fds: tuple[int, int, int], uid: int | None,
              worker_pid: int) -> None:
    """In the forked child: confine this process, then run `program`, either {"python": path of the
    source file, "source": its text} or {"argv": a command to execute}. Never returns."""
    try:
        confine(limits, run_dir, fds, uid, worker_pid)
        if "argv" in program:
            os.execv(program["argv"][0], program["argv"])
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # line-buffered, as Python's own stderr
        os._exit = flushing_exit  # the program's os._exit keeps what it printed (rStar2-Agent's tool wrapper exits so)
        name = os.path.basename(program["python"])
        sys.argv = [name]  # as under `python solution.py` in its directory
        sys.path[0] = run_dir  # was this file's directory
    except BaseException:
        os._exit(SETUP_FAILED)
    status = 0
    try:
        # By its relative name: tracebacks read the lines from the file, and do not show our temp path.
        code = compile(program["source"], name, "exec")
        exec(code, {"__name__": "__main__", "__file__": program["python"], "__builtins__": builtins})
    except SystemExit as stop:
        status = exit_status(stop)
    except BaseException as error:
        # Leave this file's frame out: the traceback starts in the program, as under `python solution.py`.
        traceback.print_exception(type(error), error, error.__traceback__.tb_next)
        status = 1
    flush_output()  # what it printed survives a kill while its threads or children end
    flushing_exit(finish_interpreter(status) & 0xFF)


def exit_status(stop: SystemExit) -> int:
    """The exit status `sys.exit(code)` gives, printing a non-integer code as Python does."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def finish_interpreter(status: int) -> int:
    """What the interpreter does when a program ends: join its non-daemon threads, then run its atexit
    handlers (multiprocessing's joins the processes it started). CPython's own forked children end
    so too (`multiprocessing.process.BaseProcess._bootstrap`)."""
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        import atexit
        atexit._run_exitfuncs()
    except SystemExit as stop:
        return exit_status(stop)
    except BaseException:
        traceback.print_exc()
        return status or 1
    return status


def clear_scratch(dirs: list[str], keep: set[str]) -> None:
    """Delete everything a program left in the writable directories (its run directory and, inside
    the namespace, the private /tmp and /dev/shm), so nothing carries over to the next program."""
    for directory in dirs:
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if path in keep:
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass


SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # world-writable on the host


def modification_times(dirs: tuple[str, ...]) -> dict[str, int]:
    times = {}
    for directory in dirs:
        try:
            times[directory] = os.stat(directory).st_mtime_ns
        except OSError:
            pass
    return times


def clear_owned(before: dict[str, int], uid: int) -> None:
    """Without a private /tmp (the uid fallback): delete what the program's uid left at the top of
    the host's world-writable directories. A directory whose modification time has not moved has
    no new entry, so only changed ones are listed (and ones changed just before the run, as the
    clock behind modification times is coarse)."""
    recent = time.time_ns() - 20_000_000  # a few timer ticks
    for directory, mtime in modification_times(tuple(before)).items():
        if mtime == before[directory] and mtime < recent:
            continue
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            try:
                if os.lstat(path).st_uid != uid:
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
            except OSError:
                pass


def read_capped(path: str, limit: int, size: int | None = None) -> tuple[str, bool]:
    """The first `limit` characters (UTF-8, invalid bytes replaced) of a file, or of its first `size`
    bytes, and whether it had more."""
    wanted = 4 * limit + 4  # a character takes at most 4 bytes
    with open(path, "rb") as f:
        data = f.read(wanted if size is None else min(size, wanted))
        more = f.read(1) != b"" if size is None else size > wanted
    # A cut at `size` may split a character: leave its first bytes out rather than replace them.
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=size is None)
    return text[:limit], more or len(text) > limit


def classify(status: int, timed_out: bool, cpu_limited: bool, stderr: str, truncated: bool) -> str:
    if timed_out or cpu_limited:
        return "timeout"
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXFSZ:
        return "output_limit"
    if status != 0 and any(marker in stderr[-2000:] for marker in ("MemoryError", "std::bad_alloc")):
        return "memory"
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == SETUP_FAILED:
        return "sandbox_error"
    if truncated:
        return "output_limit"
    return "ok" if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else "error"


def orphans_ended() -> bool:
    """Reap the program's processes that have ended (they are re-parented to us, a child subreaper,
    when their parents exit); whether none is left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return False


def watch(pid: int, deadline: float, outputs: list[int]) -> tuple[tuple | None, list[int] | None]:
    """Wait until the program `pid` and every process it started have ended, or until `deadline`.
    Returns the program's (status, usage) from `wait4` (None while it runs) and, if the deadline came
    first, the sizes of the `outputs` (fds) at the last moment known to be before it (else None)."""
    pidfd = os.pidfd_open(pid)
    ended, kept = None, [0] * len(outputs)
    try:
        while True:
            sizes = [os.fstat(fd).st_size for fd in outputs]
            if ended is None and select.select([pidfd], [], [], 0)[0]:
                ended = os.wait4(pid, 0)[1:]
            finished = ended is not None and orphans_ended()
            # A look counts only if this clock reading puts it before the deadline: the program can
            # write (or end) between any look and the kill, in the same millisecond or, after a late
            # wake-up (timer slack, a loaded machine), much later. So a timed-out program's output
            # is cut where our last look before the deadline found it.
            now = time.monotonic()
            if now >= deadline:
                return ended, kept
            if finished:
                return ended, None
            kept = sizes
            # Look again halfway to the deadline (down to CUT_POLL), so a worker held up near it (a
            # loaded machine) still has a recent look from before it; a program that ends wakes us.
            wait = max(CUT_POLL, (deadline - now) / 2)
            if ended is None:
                select.select([pidfd], [], [], wait)
            else:
                time.sleep(min(wait, ORPHAN_POLL))
    finally:
        os.close(pidfd)


def execute(program: dict, limits: dict, run_dir: str, paths: tuple[str, str, str], uid: int | None,
            output_limit: int) -> dict:
    """Run `program` (see `run_child`) with stdin, stdout and stderr on `paths` (stdout and stderr may
    be one file) and describe what happened. The run ends when the program and every process it
    started have ended, or at its deadline, counted from before the fork: then what still runs is
    killed, and the output is what was written before the deadline."""
    stdin = os.open(paths[0], os.O_RDONLY)
    outputs = {path: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for path in paths[1:]}
    fds = (stdin, outputs[paths[1]], outputs[paths[2]])
    start = time.monotonic()
    deadline = start + limits["timeout"]
    worker_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        run_child(program, limits, run_dir, fds, uid, worker_pid)
    os.close(stdin)
    ended, cut = watch(pid, deadline, list(outputs.values()))
    timed_out = cut is not None
    kill_group(pid)  # the program's group (it called setsid), forks included
    if ended is None:
        os.kill(pid, signal.SIGKILL)
        ended = os.wait4(pid, 0)[1:]
    wall = time.monotonic() - start
    kill_descendants()
    for fd in outputs.values():
        os.close(fd)
    sizes = dict(zip(outputs, cut)) if timed_out else {}
    stdout, out_cut = read_capped(paths[1], output_limit, sizes.get(paths[1]))
    stderr, err_cut = read_capped(paths[2], output_limit, sizes.get(paths[2]))
    status, usage = ended
    cpu_limited = os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL) and (
        usage.ru_utime + usage.ru_stime >= int(limits["timeout"] + 0.999) - 0.05
    )
    signaled = os.WIFSIGNALED(status)
    return {
        "stdout": stdout,
        "stderr": stderr,
        "exit_code": None if signaled else os.WEXITSTATUS(status),
        "signal": os.WTERMSIG(status) if signaled else None,
        "wall_time": wall,
        "reason": classify(status, timed_out, cpu_limited, stderr, out_cut or err_cut),
        "truncated": out_cut or err_cut,
    }


def write_source(run_dir: str, name: str, code: str) -> str:
    path = os.path.join(run_dir, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(code)
    os.chmod(path, 0o644)  # readable by the program's uid
    return path


COMPILE_MEMORY_MB = 2048  # g++'s address-space limit: cc1plus needs more than a program usually gets
CPP_FLAGS = ("-O2", "-pipe", "-o", "solution", "solution.cpp")  # code-judge's (-pipe: no temporary files)


def run_program(request: dict, run_dir: str, paths: tuple[str, str, str], uid: int | None,
                compilers: dict[str, str | None]) -> dict:
    """Run the request's program: Python in a forked child, C++ compiled with g++ (under its own time
    limit, `compile_timeout`, as code-judge gives compilation one) and then executed."""
    limits = {key: request[key] for key in ("timeout", "memory_mb", "file_size_mb", "nproc")}
    language = request.get("language", "python")
    if language == "python":
        program = {"python": write_source(run_dir, "solution.py", request["code"]), "source": request["code"]}
        return execute(program, limits, run_dir, paths, uid, request["output_limit"])
    if language != "cpp":
        raise ValueError(f"unknown language {language!r}")
    if compilers.get("cpp") is None:
        return {"stdout": "", "stderr": "C++ cannot run here: g++ is not installed", "exit_code": None,
                "signal": None, "wall_time": 0.0, "reason": "not_installed", "truncated": False}
    write_source(run_dir, "solution.cpp", request["code"])
    compile_limits = limits | {"timeout": request["compile_timeout"],
                               "memory_mb": max(limits["memory_mb"], COMPILE_MEMORY_MB)}
    compiled = execute({"argv": [compilers["cpp"], *CPP_FLAGS]}, compile_limits, run_dir,
                       (os.devnull, paths[2], paths[2]), uid, request["output_limit"])
    if compiled["reason"] != "ok":
        if compiled["reason"] == "timeout":
            late = f"compilation did not finish within {compile_limits['timeout']:g}s"
            compiled["stderr"] = "\n".join(filter(None, (compiled["stderr"].rstrip("\n"), late)))
        return compiled | {"reason": "compile_error", "stdout": ""}
    return execute({"argv": [os.path.join(run_dir, "solution")]}, limits, run_dir, paths, uid, request["output_limit"])


def run(request: dict, base_dir: str, io_dir: str, scratch_dirs: list[str], keep: set[str], uid: int | None,
        in_namespace: bool, compilers: dict[str, str | None]) -> dict:
    """Execute one program in a fresh directory, then wipe what it left."""
    run_dir = tempfile.mkdtemp(dir=base_dir)
    if uid is not None:
        os.chown(run_dir, uid, uid)
    paths = tuple(os.path.join(io_dir, name) for name in ("stdin", "stdout", "stderr"))
    with open(paths[0], "w", encoding="utf-8") as f:
        f.write(request["stdin"])
    shared_before = modification_times(SHARED_DIRS) if uid is not None and not in_namespace else {}
    try:
        return run_program(request, run_dir, paths, uid, compilers)
    finally:
        if uid is not None:
            kill_uid(uid)
        clear_scratch(scratch_dirs, keep)
        if shared_before:
            clear_owned(shared_before, uid)


def main() -> None:
    settings = json.loads(sys.argv[1])
    if "kill_uids" in settings:  # not a worker: the sandbox's sweep of its uids (it runs as root)
        for uid in settings["kill_uids"]:
            kill_uid(uid)
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1 and not settings["in_namespace"]:
        return  # the parent died before we set the death signal
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    network = "shared"
    if settings["unshare_net"]:
        network = "isolated" if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) == 0 else "shared"
    for module in settings["preload"]:
        try:
            __import__(module)
        except Exception as error:  # a missing optional module only loses the speed-up
            print(f"rl2 sandbox worker: cannot preload {module}: {error}", file=sys.stderr)
    # Keep the protocol on private fds and point 0/1 at harmless files, so a stray print in the
    # worker cannot corrupt a frame.
    requests, responses = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    base_dir = settings["base_dir"]  # private to this sandbox: everything in it but io_dir is wiped after each run
    io_dir = tempfile.mkdtemp(dir=base_dir, prefix=".io-")  # mode 0700: the program cannot open it by path
    uid = settings["uid"]
    if uid is not None:  # a worker that replaces a dead one: what its programs left
        kill_uid(uid)
    scratch_dirs = [base_dir] + (["/dev/shm"] if settings["in_namespace"] else [])
    # What survives the wipe: our io files, and the interpreter's own paths bound in under /tmp.
    keep = {io_dir} | {os.path.join(base_dir, name) for name in settings["keep"]}
    compilers = {"cpp": shutil.which("g++")}
    write_frame(responses, {"ready": True, "pid": os.getpid(), "network": network,
                            "languages": ["python"] + [language for language, path in compilers.items() if path]})
    while (request := read_frame(requests)) is not None:
        try:
            response = run(request, base_dir, io_dir, scratch_dirs, keep, uid, settings["in_namespace"], compilers)
        except Exception:
            response = {"reason": "sandbox_error", "stdout": "", "stderr": traceback.format_exc(),
                        "exit_code": None, "signal": None, "wall_time": 0.0, "truncated": False}
        write_frame(responses, response)
    shutil.rmtree(io_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
