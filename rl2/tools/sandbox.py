"""A local sandbox for untrusted Python and C++ (the code tool's default executor).

Generated code is hostile. `Sandbox` keeps a bounded pool of warm worker processes
(`sandbox_worker.py`); each program runs in a child forked from a worker, in its own session and
process group, in a fresh temporary directory, with CPU, address-space, file-size and process-count
limits and an environment that holds nothing of ours. A run ends when the program and every process
it started have ended; its wall-clock deadline is counted from before the fork, whatever still runs
then is killed (reason "timeout"), and what was written after the deadline is not in the result. A
Python program ends as under `python solution.py`: its non-daemon threads are joined and its atexit
handlers run, and `os._exit` keeps what it printed.
C++ is compiled with g++ (`-O2`, as code-judge does; within `compile_timeout`) and then run the same way.
Isolation (`isolation="auto"`, the default, is "bwrap"; the weaker modes only when asked for:
`allow_fallback=True`, an explicit isolation, or RL2_SANDBOX_FALLBACK=1; else SandboxError):

- "bwrap": the workers run inside bubblewrap with new mount, pid, network, ipc and uts namespaces,
  a read-only system (/usr, /etc, /opt, ...), private size-limited /tmp and /dev/shm, and every other
  top-level directory (/home, /root, /run, /var, /work, ...) an empty read-only tmpfs with only the
  interpreter's paths bound back: a program cannot reach the network, the host's unix sockets, its
  processes, the checkout or other runs' files, or write anywhere but its temporary directories; as
  root each worker's programs also run under a uid of their own, so they cannot signal the worker
  or other programs.
- "uid" (root without bubblewrap): programs run under a per-worker unprivileged uid (so the
  process limit applies), in a new network namespace when the kernel allows it. It does not contain
  them (`UID_GAPS`, logged as a warning): they read what other users may read, see every process's
  command line, reach unix sockets, and write to world-writable directories (what their uid left at
  the top of /tmp, /var/tmp, /dev/shm, /run/lock is deleted after each run). If the interpreter
  lives in a directory other users cannot enter (pyenv under /root) they can import only the
  modules preloaded in the workers (`preload`).
- "none": resource limits, sessions and the timeout only. Logged as a warning.

As root (bwrap or uid) every worker's uid is its own on the whole machine: a sandbox claims free uids
from `uid_base` on (a lock file each under /run/rl2-sandbox-uids, held while it runs), so two
sandboxes (two code servers, a trainer's env workers beside a test) never share one, and every
process of a claimed uid belongs to that worker's programs. That makes cleanup total: when the uid
is claimed, after each run, when a worker starts (one that replaces a dead worker) and when the
sandbox closes, every process of the uid is killed, including any that left the worker's process
tree (under "uid" a program's daemon outlived a worker killed mid-run, or a sandbox closed mid-run).

The workers form a `rl2.tools.worker_pool.WorkerPool`: a worker that dies (a kill, the OOM killer)
is replaced, the program it was running is run again on a fresh one, and `Sandbox.faults` counts
what was recovered; a program that still cannot run gets reason "sandbox_error".

    with Sandbox(workers=2) as box:
        result = box.run("print(1+1)")        # RunResult(stdout='2\\n', reason='ok', ...)
        result = box.run(CPP_SOURCE, language="cpp")
"""

import asyncio
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from rl2.tools.worker_pool import WorkerFailed, WorkerPool

logger = logging.getLogger("rl2.tools.sandbox")

# Passed to `python -c` rather than run by path: the file may live under /tmp, which bubblewrap
# replaces with an empty tmpfs.
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_worker.py")
ISOLATIONS = ("auto", "bwrap", "uid", "none")
LANGUAGES = ("python", "cpp")
# Imported once by each worker so programs using them start instantly (children share them), and
# so they work even where the sandbox uid cannot read the interpreter's files (see `uid` above).
DEFAULT_PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "heapq",
                   "bisect", "random", "statistics", "re", "string", "json", "datetime", "typing")
RESPONSE_GRACE = 10.0  # seconds a worker may take beyond a program's timeout before we give up on it
RETRIES = 1  # runs of a program on a fresh worker after its worker died: a hostile program runs at most twice


@dataclass
class RunResult:
    """What one program did. `reason` is "ok", "error" (non-zero exit or exception), "timeout" (the
    program, or a process it started, still ran at the time limit), "memory", "output_limit" (output
    cut or the file-size limit hit), "compile_error" (C++ only; `stderr` has the compiler's
    messages), "not_installed" (no compiler for the language here) or "sandbox_error"."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal or never run
    wall_time: float  # seconds
    reason: str
    truncated: bool = False
    signal: int | None = None

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


class SandboxError(RuntimeError):
    """The sandbox itself cannot run (no usable isolation, a worker that will not start)."""


def bwrap_works() -> bool:
    """Whether bubblewrap is installed and can create namespaces here."""
    if shutil.which("bwrap") is None:
        return False
    probe = subprocess.run(
        ["bwrap", "--ro-bind", "/", "/", "--unshare-pid", "--unshare-net", *_user_namespace_args(), "true"],
        capture_output=True,
    )
    return probe.returncode == 0


def _user_namespace_args() -> list[str]:
    # As root bubblewrap uses real namespaces; otherwise it needs a user namespace.
    return [] if os.geteuid() == 0 else ["--unshare-user"]


def python_paths() -> list[str]:
    """The directories this interpreter needs: its prefixes, its executable's directory, sys.path."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]
    paths += [p for p in sys.path if p and os.path.isdir(p)]
    return sorted({os.path.realpath(p) for p in paths})


def interpreter_paths() -> list[str]:
    """What the workers' interpreter needs (they run under `python -I`): its prefixes, its executable's
    directory and the sys.path entries inside those. Other sys.path entries (a checkout on PYTHONPATH,
    an editable install's source) are left out, so the sandbox does not show them to programs."""
    prefixes = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    paths = prefixes + [os.path.dirname(os.path.realpath(sys.executable))]
    for entry in sys.path:
        real = os.path.realpath(entry) if entry else ""
        if real and os.path.isdir(real) and any(real == p or real.startswith(p + "/") for p in prefixes):
            paths.append(real)
    return sorted(set(paths))


# What a bubblewrap sandbox shows of the root directory: the system (read-only) and its own /dev, /proc
# and /tmp. Every other top-level directory (/home, /root, /run, /var, /srv, /mnt, a /work or /data of
# checkouts and datasets) is an empty read-only tmpfs there, with only the interpreter's paths bound back.
SYSTEM_DIRS = frozenset({"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt", "dev", "proc",
                         "sys", "tmp"})


def hidden_dirs() -> list[str]:
    """The top-level directories a bubblewrap sandbox hides (see SYSTEM_DIRS)."""
    hidden = []
    for name in sorted(os.listdir("/")):
        path = "/" + name
        if name not in SYSTEM_DIRS and not os.path.islink(path) and os.path.isdir(path):
            hidden.append(path)
    return hidden


def hide_args(interpreter: list[str]) -> list[str]:
    """bubblewrap arguments that put an empty read-only tmpfs over each of `hidden_dirs()`, with the
    interpreter's paths inside bound back (read-only); a directory that is itself one of those paths
    (an interpreter in /venv) stays as it is."""
    args = []
    for path in hidden_dirs():
        if path in interpreter:
            continue
        inside = [p for p in interpreter if p.startswith(path + "/")]
        args += ["--perms", "0755", "--tmpfs", path, *bind_back_args(path, inside), "--remount-ro", path]
    return args


def closed_ancestor(path: str) -> str | None:
    """The outermost directory above or at `path` that other users cannot enter (e.g. /root, 0700)."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        if not os.stat(current).st_mode & 0o001:
            return current
    return None


def expose_python_args() -> list[str]:
    """bubblewrap arguments that let an unprivileged uid use this interpreter when it lives under a
    closed directory (pyenv in /root): hide that directory behind an empty tmpfs and bind only the
    interpreter's paths back, read-only. The rest of the closed directory stays invisible."""
    hidden: dict[str, list[str]] = {}
    tops = set(hidden_dirs())  # hidden whole, the interpreter bound back traversable (hide_args)
    for path in python_paths():
        ancestor = closed_ancestor(path)
        if ancestor is not None and "/" + ancestor.split("/")[1] not in tops:
            hidden.setdefault(ancestor, []).append(path)
    args = []
    for ancestor, paths in sorted(hidden.items()):
        # A path that is itself the closed directory (a checkout in a 0700 `mktemp -d` on sys.path)
        # stays closed to the uid either way; the worker runs with `-I` and does not need it.
        inside = [path for path in paths if path != ancestor]
        args += ["--perms", "0755", "--tmpfs", ancestor] + bind_back_args(ancestor, inside)
    return args


def bind_back_args(mount: str, paths: list[str]) -> list[str]:
    """bubblewrap arguments binding `paths` (read-only) into `mount`, a fresh tmpfs, with the
    directories between made traversable (bubblewrap would make them 0700)."""
    outside = [path for path in paths if not path.startswith(mount.rstrip("/") + "/")]
    if outside:
        raise ValueError(f"cannot bind {outside} back into {mount}: not inside it")
    args, made, bound = [], {mount}, []
    for path in sorted(paths):  # a directory comes before what is inside it
        if any(path.startswith(done + "/") for done in bound):
            continue
        parent, missing = os.path.dirname(path), []
        while parent not in made:
            missing.append(parent)
            parent = os.path.dirname(parent)
        for directory in reversed(missing):
            args += ["--perms", "0755", "--dir", directory]
            made.add(directory)
        args += ["--ro-bind", path, path]
        made.add(path)
        bound.append(path)
    return args


FALLBACK_ENV = "RL2_SANDBOX_FALLBACK"  # "1": let isolation="auto" fall back to "uid"/"none" without bubblewrap
UID_GAPS = ("programs can read every file other users may read (the checkout, datasets and their answers, other "
            "runs' files) and every process's command line in /proc, connect to unix sockets other users may "
            "open, write to world-writable directories (/tmp, /var/tmp, /dev/shm and /run/lock: what their uid "
            "left at the top of these is deleted after each run) and fill /dev/shm (RLIMIT_FSIZE caps each file, "
            "not their number)")


def fallback_allowed(allow_fallback: bool | None) -> bool:
    if allow_fallback is not None:
        return bool(allow_fallback)
    return os.environ.get(FALLBACK_ENV, "").strip().lower() in ("1", "true", "yes", "uid", "none")


def resolve_isolation(isolation: str, allow_fallback: bool | None = None) -> str:
    """The isolation to use. "auto" is bubblewrap; without it (missing, or no namespaces here) it falls
    back to "uid" (root) or "none" only when asked to (`allow_fallback`, or RL2_SANDBOX_FALLBACK=1),
    else refuses: those modes do not contain a hostile program (UID_GAPS)."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == "bwrap" and not bwrap_works():
        raise SandboxError("sandbox isolation 'bwrap' requested but bubblewrap is missing or cannot create namespaces "
                           "here (Debian/Ubuntu: apt-get install bubblewrap)")
    if isolation == "uid" and os.geteuid() != 0:
        raise SandboxError("sandbox isolation 'uid' needs root (to switch programs to an unprivileged uid)")
    if isolation != "auto":
        return isolation
    if bwrap_works():
        return "bwrap"
    weaker = "uid" if os.geteuid() == 0 else "none"
    if not fallback_allowed(allow_fallback):
        raise SandboxError(
            f"the sandbox needs bubblewrap (`bwrap`), which is missing or cannot create namespaces here: install it "
            f"(`make sandbox-tools`; Debian/Ubuntu: apt-get install bubblewrap), or accept the weaker {weaker!r} "
            f"isolation explicitly: Sandbox(allow_fallback=True) or isolation={weaker!r}, or {FALLBACK_ENV}=1 in the "
            f"environment (code_server.py: --isolation {weaker}). In the {weaker!r} mode "
            + (UID_GAPS if weaker == "uid" else "programs are not isolated at all: resource limits and timeouts only"))
    return weaker


def worker_command(isolation: str, uid: int | None, base_dir: str | None, tmpfs_mb: int,
                   preload: list[str]) -> list[str]:
    """The command line of one sandbox worker: `sandbox_worker.py`, wrapped in bubblewrap for "bwrap"."""
    # An interpreter (a venv, an editable install) under /tmp must stay visible over the private /tmp.
    interpreter = interpreter_paths()
    under_tmp = [p for p in interpreter if p.startswith("/tmp/")]
    settings = {
        "keep": [path.split("/")[2] for path in under_tmp] if isolation == "bwrap" else [],
        "uid": uid,
        "base_dir": "/tmp" if isolation == "bwrap" else base_dir,
        "in_namespace": isolation == "bwrap",
        "unshare_net": isolation == "uid",
        "preload": preload,
    }
    with open(WORKER_SCRIPT, encoding="utf-8") as f:
        python = [sys.executable, "-I", "-c", f.read(), json.dumps(settings)]
    if isolation != "bwrap":
        return python
    wrapper = [
        "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
        "--perms", "1777", "--size", str(tmpfs_mb * 1024 * 1024), "--tmpfs", "/tmp",
        "--perms", "1777", "--size", str(tmpfs_mb * 1024 * 1024), "--tmpfs", "/dev/shm",
        *bind_back_args("/tmp", under_tmp), *hide_args(interpreter),
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        *_user_namespace_args(), "--die-with-parent", "--new-session", "--chdir", "/tmp",
    ]
    if uid is not None:
        wrapper += expose_python_args()
    if os.geteuid() == 0:  # the worker keeps only what it needs to hand programs their own uid
        wrapper += ["--cap-drop", "ALL"]
        for cap in ("SETUID", "SETGID", "KILL", "CHOWN", "DAC_OVERRIDE", "FOWNER"):
            wrapper += ["--cap-add", f"CAP_{cap}"]
    return wrapper + python


UID_LOCK_DIR = "/run/rl2-sandbox-uids"
UID_SEARCH = 100_000  # how far past uid_base a sandbox looks for free uids


def uid_lock_dir() -> str:
    """Where the uids' lock files live: /run (root's, one per machine), else the temporary directory."""
    for directory in (UID_LOCK_DIR, os.path.join(tempfile.gettempdir(), "rl2-sandbox-uids")):
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            return directory
        except OSError:
            continue
    raise SandboxError(f"cannot create {UID_LOCK_DIR} (the sandbox uids' locks)")


class UidClaims:
    """`count` uids from `first` on that no other sandbox on this machine holds: each is held by an
    exclusive lock (flock) on its file in `lock_dir` until `release` (or this process ends)."""

    def __init__(self, first: int, count: int, lock_dir: str | None = None):
        lock_dir = lock_dir or uid_lock_dir()
        info = os.stat(lock_dir)
        if info.st_uid != os.geteuid() or info.st_mode & 0o022:
            raise SandboxError(f"{lock_dir} must be a directory of uid {os.geteuid()} that others cannot write "
                               f"(it holds the sandbox uids' locks)")
        self.uids: list[int] = []
        self._files: list[int] = []
        for uid in range(first, first + UID_SEARCH):
            if len(self.uids) == count:
                break
            fd = os.open(os.path.join(lock_dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another sandbox's
                os.close(fd)
                continue
            self.uids.append(uid)
            self._files.append(fd)
        if len(self.uids) < count:
            self.release()
            raise SandboxError(f"no {count} free sandbox uids in {first}..{first + UID_SEARCH - 1}")

    def release(self) -> None:
        for fd in self._files:
            os.close(fd)
        self._files, self.uids = [], []


def kill_processes_of(uids: list[int], wait: float = 5.0) -> None:
    """SIGKILL every process running under one of `uids` (sandbox uids: their programs and whatever
    these left), then wait up to `wait` s for them to end. Needs root: the worker script, started in
    its sweep mode, takes each uid in turn and kills every process that uid may signal."""
    if not uids:
        return
    with open(WORKER_SCRIPT, encoding="utf-8") as f:
        subprocess.run([sys.executable, "-I", "-c", f.read(), json.dumps({"kill_uids": uids})],
                       env=_worker_environment(), cwd="/", stdout=subprocess.DEVNULL, check=False)
    deadline = time.monotonic() + wait
    while processes_of(uids) and time.monotonic() < deadline:
        time.sleep(0.01)


def processes_of(uids: list[int]) -> list[int]:
    """Pids of the processes whose real uid is one of `uids`, but those that have ended (zombies not
    yet reaped by their parent)."""
    found, wanted = [], set(uids)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if line.startswith(("State:", "Uid:")))
            except (OSError, ValueError):
                continue
            if "Uid" in fields and int(fields["Uid"].split()[0]) in wanted and fields["State"].split()[0] not in "ZX":
                found.append(int(name))
    return found


def _worker_environment() -> dict[str, str]:
    """The worker's whole environment: nothing of the parent's (secrets, tokens) is passed on."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


class Sandbox:
    """A bounded pool of warm, isolated Python executors. `run` is thread-safe and blocks while all
    `workers` are busy; `run_async` does the same without blocking an event loop. A worker that
    dies is replaced and the program it was running is run once more on a fresh one (a program that
    kills its worker twice gets reason "sandbox_error"); `faults` counts `sandbox_restarts`,
    `sandbox_retries` and `sandbox_timeouts` (a worker that gave no answer in time). `output_limit`
    is in characters, for stdout and stderr each (invalid UTF-8 is replaced, not an error);
    `languages` says what the workers can run."""

    def __init__(
        self,
        workers: int = 2,
        timeout: float = 10.0,
        memory_mb: int = 512,
        output_limit: int = 65536,
        isolation: str = "auto",
        file_size_mb: int = 16,
        max_processes: int = 64,
        tmpfs_mb: int = 256,
        uid_base: int = 600000,
        compile_timeout: float = 10.0,
        preload: list[str] | tuple[str, ...] = DEFAULT_PRELOAD,
        allow_fallback: bool | None = None,
    ):
        if workers < 1:
            raise ValueError(f"sandbox workers must be at least 1, got {workers}")
        if timeout <= 0 or memory_mb <= 0 or output_limit <= 0 or compile_timeout <= 0:
            raise ValueError("sandbox timeout, compile_timeout, memory_mb and output_limit must be positive")
        self.compile_timeout = float(compile_timeout)
        self.workers = workers
        self.timeout, self.memory_mb, self.output_limit = float(timeout), int(memory_mb), int(output_limit)
        self.file_size_mb, self.max_processes = int(file_size_mb), int(max_processes)
        kind = resolve_isolation(isolation, allow_fallback)
        privileged = os.geteuid() == 0 and kind != "none"
        self._closed = False
        self._claims = UidClaims(uid_base, workers) if privileged else None
        self.uids = list(self._claims.uids) if self._claims else []  # the programs' uids, this sandbox's alone
        kill_processes_of(self.uids)  # left by an earlier owner that died before it could clean up
        self._base_dir = None if kind == "bwrap" else tempfile.mkdtemp(prefix="rl2-sandbox-")
        if self._base_dir:
            os.chmod(self._base_dir, 0o711)  # programs under other uids reach their own dirs, cannot list
        commands = []
        for i in range(workers):
            base_dir = None
            if self._base_dir:  # one directory each: a worker wipes its own after every program
                base_dir = os.path.join(self._base_dir, f"worker{i}")
                os.mkdir(base_dir, 0o711)
            uid = self.uids[i] if privileged else None
            commands.append(worker_command(kind, uid, base_dir, tmpfs_mb, list(preload)))
        try:
            # Unguarded: a sandbox worker runs no user code in its own process and is its programs' subreaper;
            # what they start is contained by their pid namespace (bwrap) or killed by their uid (uid mode).
            self._pool = WorkerPool("sandbox", commands, retries=RETRIES, env=_worker_environment(), guarded=False)
        except WorkerFailed as error:
            self.close()
            raise SandboxError(f"sandbox workers ({kind}) did not start: {error}") from None
        except BaseException:
            self.close()
            raise
        self.faults = self._pool.faults
        # What the workers can run (C++ needs g++ where they run).
        self.languages = tuple(self._pool.ready_frames()[0]["languages"])
        self.isolation = self._describe(kind, privileged)
        # Weaker than namespaces (shared /tmp, or no isolation at all): a warning, seen where logging is not
        # configured (a notebook, an env worker process, whose stderr reaches the run's).
        log = logger.info if kind == "bwrap" else logger.warning
        log("sandbox: %d workers, isolation: %s", workers, self.isolation)
        if kind == "uid":
            logger.warning("sandbox: the uid isolation (no bubblewrap) does not contain a hostile program: %s. "
                           "Install bubblewrap (`make sandbox-tools`) for the isolation meant for RL rollouts",
                           UID_GAPS)
        closed = sorted({a for a in map(closed_ancestor, python_paths()) if a})
        if kind == "uid" and closed:
            logger.warning("sandbox: the interpreter is under %s, which uid %d cannot read: programs can import only "
                           "the modules preloaded in the workers (%s); install bubblewrap to lift this",
                           ", ".join(closed), self.uids[0], ", ".join(preload))

    def _describe(self, kind: str, privileged: bool) -> str:
        uids = f"uids {', '.join(map(str, self.uids))}" if privileged else "the caller's uid"
        if kind == "bwrap":
            return (f"bwrap (new mount/pid/net/ipc namespaces, read-only root, private /tmp; programs run under {uids})")
        if kind == "uid":
            isolated = self._pool.ready_frames()[0]["network"] == "isolated"
            network = "no network (own namespace)" if isolated else "network NOT isolated"
            return f"uid (programs run under {uids}, {network}; world-writable dirs such as /tmp are shared)"
        return "none (resource limits and timeouts only: no namespaces, network and files NOT isolated)"

    def run(self, code: str, stdin: str = "", timeout: float | None = None, memory_mb: int | None = None,
             language: str = "python") -> RunResult:
        """Run `code`, a program in `language` ("python" or "cpp"), with `stdin`; see `RunResult`.
        C++ is compiled first, with a time limit of its own."""
        if not isinstance(code, str) or not isinstance(stdin, str):
            raise TypeError("sandbox code and stdin must be strings")
        if language not in LANGUAGES:
            raise ValueError(f"sandbox language must be one of {LANGUAGES}, got {language!r}")
        request = {
            "language": language,
            "code": code,
            "stdin": stdin,
            "timeout": float(timeout or self.timeout),
            "compile_timeout": self.compile_timeout,
            "memory_mb": int(memory_mb or self.memory_mb),
            "output_limit": self.output_limit,
            "file_size_mb": self.file_size_mb,
            "nproc": self.max_processes,
        }
        try:
            compiling = self.compile_timeout if language == "cpp" else 0.0
            return RunResult(**self._pool.call(request, compiling + request["timeout"] + RESPONSE_GRACE))
        except WorkerFailed as error:  # WorkerTimeout included
            return RunResult("", f"sandbox error: {error}", None, 0.0, "sandbox_error")

    async def run_async(self, code: str, stdin: str = "", timeout: float | None = None,
                        memory_mb: int | None = None, language: str = "python") -> RunResult:
        return await asyncio.to_thread(self.run, code, stdin, timeout, memory_mb, language)

    def close(self) -> None:
        """Stop the workers and kill every process of the sandbox's uids (a program running now, and
        what it started), then give the uids back."""
        self._closed = True
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close()
        claims = getattr(self, "_claims", None)
        if claims is not None and claims.uids:
            kill_processes_of(claims.uids)
            claims.release()
        if getattr(self, "_base_dir", None):
            shutil.rmtree(self._base_dir, ignore_errors=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close()


def run_python(code: str, stdin: str = "", timeout: float = 10.0, memory_mb: int = 512,
               sandbox: Sandbox | None = None) -> RunResult:
    """Run one program. Pass a long-lived `sandbox` to reuse warm workers; without one a sandbox
    with a single worker is started and stopped around the call (tens of milliseconds)."""
    if sandbox is not None:
        return sandbox.run(code, stdin, timeout, memory_mb)
    with Sandbox(workers=1, timeout=timeout, memory_mb=memory_mb) as box:
        return box.run(code, stdin)


__all__ = ["RunResult", "Sandbox", "SandboxError", "run_python"]
