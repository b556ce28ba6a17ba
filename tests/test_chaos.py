"""Chaos: a 2-rank PPO run whose grader and sandbox worker processes are SIGKILLed at seeded random
moments. The run must finish every step, score every reply exactly as without the kills (no env
error, no wrong reward), and report the restarts in its `faults/*` metrics."""

import json
import os
import random
import signal
import threading
import time

from conftest import run_torchrun
from rl2.metrics import read_metrics
from test_ppo import _ppo_args, rl_data  # noqa: F401  (the fixture)

ENV_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "envs", "chaos_tools.py")
STEPS = 8
# What identifies each pool's worker process on its command line: the grader runs a module; a sandbox
# worker runs its script with its settings (JSON) as the argument.
WORKER_MARKS = {"grader": "rl2.tools.grader_worker", "sandbox": '"in_namespace"'}


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, seconds since the process started)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None
    return int(fields[1]), uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _kind(cmdline: list[str]) -> str | None:
    if not cmdline or cmdline[0].endswith("bwrap"):  # the sandbox's wrapper: its python child is the worker
        return None
    joined = " ".join(cmdline)
    return next((kind for kind, mark in WORKER_MARKS.items() if mark in joined), None)


def worker_processes(root: int, min_age: float) -> list[tuple[int, str]]:
    """(pid, "grader" | "sandbox") of the pool workers descended from `root` that have run at least
    `min_age` seconds (a fresh one is left to start). A program a sandbox worker forked is not one:
    its parent is that worker."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        kind, stat = _kind(_cmdline(pid)), _stat(pid)
        if kind is None or stat is None or stat[1] < min_age or _kind(_cmdline(stat[0])) is not None:
            continue
        ancestor = stat[0]
        while ancestor not in (root, 0, 1):
            parent = _stat(ancestor)
            ancestor = parent[0] if parent else 0
        if ancestor == root:
            found.append((pid, kind))
    return found


def kill_workers(rng: random.Random, stop: threading.Event, kills: list[str], max_kills: int) -> None:
    """Every 0.3 to 1.2 s (seeded), SIGKILL one worker of this process's descendants: a grader and a
    sandbox worker in turn, which one of its kind at random."""
    while len(kills) < max_kills and not stop.wait(rng.uniform(0.3, 1.2)):
        kind = ("grader", "sandbox")[len(kills) % 2]
        workers = sorted(pid for pid, its_kind in worker_processes(os.getpid(), min_age=1.0) if its_kind == kind)
        if not workers:
            continue
        try:
            os.kill(rng.choice(workers), signal.SIGKILL)
            kills.append(kind)
        except ProcessLookupError:
            pass


def test_run_survives_killed_grader_and_sandbox_workers(tiny_model_dir, rl_data, tmp_path):
    save_dir = tmp_path / "run"
    kills: list[str] = []
    stop = threading.Event()
    killer = threading.Thread(target=kill_workers, args=(random.Random(0), stop, kills, 10), daemon=True)

    def stop_before_the_last_steps() -> None:  # two steps left, in which every killed worker is found dead
        while not stop.is_set():
            if (save_dir / "trajectories" / f"step_{STEPS - 2}.jsonl").exists():
                stop.set()
            time.sleep(0.2)

    watcher = threading.Thread(target=stop_before_the_last_steps, daemon=True)
    killer.start()
    watcher.start()
    try:
        run_torchrun(_ppo_args(tiny_model_dir, rl_data, str(save_dir), f"rollout.env_path={ENV_FILE}",
                               f"trainer.total_steps={STEPS}", "trainer.test_freq=null"), timeout=600)
    finally:
        stop.set()
        killer.join()
        watcher.join()

    assert {"grader", "sandbox"} <= set(kills), f"the killer found no worker of some pool to kill: {kills}"
    rows = read_metrics(str(save_dir / "metrics.jsonl"))
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # no step lost
    for row in rows:
        dump = [json.loads(line) for line in open(save_dir / "trajectories" / f"step_{row['step']}.jsonl")]
        errors = [error for trajectory in dump for error in trajectory["errors"]]
        assert row["env_errors"] == row["excluded"] == 0 and not errors, (row["step"], kills, errors)
        for trajectory in dump:  # every reply scored as it would be without the kills
            assert trajectory["reward"] == float(len(trajectory["messages"][-1]["content"]) % 2 == 0), trajectory
    for kind in ("grader", "sandbox"):
        restarts = sum(row.get(f"faults/{kind}_restarts", 0) for row in rows)
        # each kill is found (by the call that meets the dead worker, or that it dies under) and mended once
        assert restarts == kills.count(kind), (kind, restarts, kills)
