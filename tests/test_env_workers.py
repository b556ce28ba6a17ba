"""Env files as users write them: sync functions that call signal-based libraries (math-verify),
crash, hang in C or allocate without bound run in env worker processes, each failure costing one
call; files named like a package they import; RL2's newer env interface; workers that cannot start;
and PPO runs in which no reward can be computed, which stop loudly."""

import json
import os
import sys
import time

import pytest

from conftest import run_torchrun
from rl2.metrics import read_metrics
from rl2.rollout.env import Env, EnvError, EnvResult, default_env_workers
from rl2.tools.math_grader import MathGrader
from rl2.tools.worker_pool import WorkerFailed
from test_ppo import _ppo_args, rl_data  # noqa: F401  (the fixture)

# The reward function a user writes first: math-verify called directly, in the env file.
MATH_VERIFY_ENV = """
from math_verify import parse, verify


def reward_fn(messages, answer):
    return float(verify(parse(answer), parse(messages[-1]["content"])))
"""

# Sync functions that fail the hard ways, as their answer says.
HOSTILE_ENV = """
import ctypes
import os
import signal

HELD = []  # what "allocate" took: it stays held by the worker after its MemoryError (a leak)


def reward_fn(messages, answer):
    if answer == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if answer == "hang in C":
        ctypes.CDLL(None).sleep(1000)  # no Python code runs: nothing but a kill stops it
    if answer == "allocate":
        while True:
            HELD.append(bytearray(64 * 1024 * 1024))
    bytearray(160 * 1024 * 1024)  # room a call needs: a worker still holding the leak has none
    return 1.0
"""


def reply(text: str) -> list[dict]:
    return [{"role": "user", "content": "question"}, {"role": "assistant", "content": text}]


def write(folder, name: str, source: str) -> str:
    path = folder / name
    path.write_text(source)
    return str(path)


# ----------------------------------------------------------------------------------------------
# signal-based libraries, crashes, hangs and memory


def test_math_verify_called_directly_scores_in_env_workers_not_in_threads(tmp_path):
    path = write(tmp_path, "math_env.py", MATH_VERIFY_ENV)
    conversations = [reply("so x = \\boxed{\\frac{1}{2}}"), reply("\\boxed{3}"), reply("it is $\\sqrt{8}$"), reply("7")]
    answers = ["0.5", "4", "$2\\sqrt{2}$", "8"]
    with Env(path) as env:
        assert env.mode == "processes"  # the default
        assert [r.value for r in env.rewards(conversations, answers)] == [1.0, 0.0, 1.0, 0.0]
    with Env(path, workers=0) as env:  # why threads are not the default: math-verify refuses them
        results = env.rewards(conversations[:1], answers[:1])
    assert results[0].value is None and "doesn't support threaded environment" in results[0].error


def test_a_crash_a_hang_in_c_and_a_memory_blow_up_each_cost_one_call(tmp_path):
    path = write(tmp_path, "hostile_env.py", HOSTILE_ENV)
    answers = ["segfault", "ok", "hang in C", "ok", "allocate", "ok"]
    with Env(path, workers=2, timeout=2.0, memory_mb=512) as env:
        start = time.monotonic()
        results = env.rewards([reply("x")] * len(answers), answers)
        elapsed = time.monotonic() - start
        assert [r.value for r in results] == [None, 1.0, None, 1.0, None, 1.0]
        segfault, hang, allocate = results[0].error, results[2].error, results[4].error
        assert "crashed its env worker process" in segfault and "SIGSEGV" in segfault
        assert "hostile_env.py" in segfault  # faulthandler's traceback, quoted from the worker's stderr
        assert hang == "reward_fn timed out after 2.0s"
        assert allocate.startswith("reward_fn raised MemoryError: past the env worker's memory limit (512 MB")
        faults = env.fault_counts()
        assert faults["env_worker_restarts"] == 3 and faults["env_worker_timeouts"] == 1  # the crash, the hang, the memory
        # The replaced workers serve the next calls: none is the one that still held the leak.
        assert [r.value for r in env.rewards([reply("x")] * 8, ["ok"] * 8)] == [1.0] * 8
    assert elapsed < 30


def test_sync_calls_use_every_worker(tmp_path):
    """A CPU-heavy reward function runs on as many processes as there are env workers."""
    path = write(tmp_path, "pid_env.py", "import os, time\n\ndef reward_fn(messages, answer):\n"
                                         "    time.sleep(0.2)\n    return float(os.getpid())\n")
    with Env(path, workers=2) as env:
        pids = {r.value for r in env.rewards([reply("x")] * 8, [None] * 8)}
    assert len(pids) == 2 and os.getpid() not in pids


def test_default_workers_follow_the_cores_of_this_rank(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_env_workers() == max(1, min(8, cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))
    assert default_env_workers() == 1


def test_worker_pools_in_env_workers_report_faults_and_end_with_the_env(tmp_path):
    """An env file's `Lazy` pools made inside env workers: their fault counters are summed over the
    workers, and their processes end when the env closes."""
    path = write(tmp_path, "pooled_env.py", """
import subprocess
from rl2.tools.faults import FaultCounter
from rl2.tools.lazy import Lazy


class Pool:
    def __init__(self):
        self.faults = FaultCounter()
        self.child = subprocess.Popen(["sleep", "600"])

    def close(self):
        self.child.kill()


pool = Lazy(Pool)


def reward_fn(messages, answer):
    made = pool.get()
    made.faults.add("tool_restarts")
    return float(made.child.pid)
""")
    env = Env(path, workers=2)
    children = {int(r.value) for r in env.rewards([reply("x")] * 6, [None] * 6)}
    assert env.fault_counts() == {"tool_restarts": 6}
    env.close()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
              for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
               for pid in children)


# ----------------------------------------------------------------------------------------------
# loading


@pytest.mark.parametrize("workers", [0, 1])
def test_an_env_file_named_like_the_package_it_imports_gets_the_package(tmp_path, workers):
    folder = tmp_path / "envs"
    folder.mkdir()
    yaml_env = write(folder, "yaml.py", "import yaml\n\ndef reward_fn(messages, answer):\n"
                                        "    return float(yaml.safe_load(answer)['score'])\n")
    math_env = write(folder, "math_verify.py", (  # no signal-based timeouts, so that threads can run it too
        "import math_verify\n\ndef reward_fn(messages, answer):\n"
        "    gold = math_verify.parse(answer, parsing_timeout=None)\n"
        "    found = math_verify.parse(messages[-1]['content'], parsing_timeout=None)\n"
        "    return float(math_verify.verify(gold, found, timeout_seconds=None))\n"))
    with Env(yaml_env, workers=workers) as env:
        assert env.rewards([reply("x")], ["{score: 0.75}"]) == [EnvResult(0.75, None)]
    with Env(math_env, workers=workers) as env:
        assert [r.value for r in env.rewards([reply("\\boxed{2}"), reply("3")], ["2", "2"])] == [1.0, 0.0]
    assert "yaml" in sys.modules and sys.modules["yaml"].__file__ != yaml_env


def test_a_file_named_like_a_package_that_is_not_installed_says_so(tmp_path):
    path = write(tmp_path, "rl2_gem_not_installed.py", "import rl2_gem_not_installed.wrappers\n\n"
                                                       "def reward_fn(messages, answer):\n    return 1.0\n")
    with pytest.raises(EnvError, match="named like the package it imports, 'rl2_gem_not_installed', which is not installed"):
        Env(path)
    assert "rl2_gem_not_installed" not in sys.modules


# An env file in RL2's interface since Oct 2025, written here after its README's description.
RL2_SAMPLE_ENV = """
from functools import partial
from RL2.datasets import Sample, base_generate


async def env_step(sample: Sample):
    return {"next_state": None, "done": True, "reward": float("42" in sample.action_text)}

generate = partial(base_generate, env_step_fn=env_step)
"""


def test_rl2_newer_env_interface_gets_a_porting_message(tmp_path):
    path = write(tmp_path, "countdown.py", RL2_SAMPLE_ENV)
    with pytest.raises(EnvError) as info:
        Env(path)
    message = str(info.value)
    assert "countdown.py" in message and "since Oct 2025" in message and "env_step and generate" in message
    assert "reward_fn(messages, answer)" in message and "docs/migration/from-rl2.md" in message
    # A file of rl2's interface may use RL2's env-file helpers (rl2's RL2 package: RL2.utils.communication's
    # async_request); one that imports more of RL2 than that is told what there is, and the same advice.
    helpers = write(tmp_path, "uses_rl2_helpers.py", "from RL2.utils.communication import async_request\n\n"
                                                      "def reward_fn(messages, answer):\n    return 1.0\n")
    with Env(helpers, workers=0) as env:
        assert env.rewards([[{"role": "assistant", "content": "x"}]], [None])[0].value == 1.0
    only_import = write(tmp_path, "imports_rl2.py", "from RL2.utils.algorithms import compute_gae\n\n"
                                                     "def reward_fn(messages, answer):\n    return 1.0\n")
    with pytest.raises(EnvError, match="RL2.datasets, RL2.utils.communication.*docs/migration/from-rl2.md"):
        Env(only_import)


# ----------------------------------------------------------------------------------------------
# workers that cannot start


def test_a_worker_that_cannot_start_shows_its_own_error(tmp_path, monkeypatch):
    """rl2 installed without its tools extra: the math grader's workers cannot import math_verify.
    The pool's error quotes what the worker said, not only that it exited."""
    shadow = tmp_path / "no_math_verify" / "math_verify"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'math_verify'\", name='math_verify')\n")
    monkeypatch.setattr(sys, "path", [str(shadow.parent), *sys.path])  # the workers' PYTHONPATH follows sys.path
    with pytest.raises(WorkerFailed) as info:
        MathGrader(workers=1, retries=0)
    message = str(info.value)
    assert "did not start" in message and "exited with code 1" in message
    assert "No module named 'math_verify'" in message and "pip install 'rl2[tools]'" in message


def test_an_env_worker_that_cannot_load_its_file_shows_why(tmp_path):
    """A file that loads in the trainer but not in a worker (here: it reads a variable only the
    trainer has): every sync call fails with the worker's own words."""
    path = write(tmp_path, "picky_env.py", "import os\nif os.getpid() != int(os.environ['RL2_TEST_TRAINER_PID']):\n"
                                           "    raise RuntimeError('only in the trainer')\n\n"
                                           "def reward_fn(messages, answer):\n    return 1.0\n")
    os.environ["RL2_TEST_TRAINER_PID"] = str(os.getpid())
    try:
        with Env(path, workers=1) as env:
            [result] = env.rewards([reply("x")], [None])
    finally:
        del os.environ["RL2_TEST_TRAINER_PID"]
    assert result.value is None and "did not start" in result.error and "only in the trainer" in result.error


# ----------------------------------------------------------------------------------------------
# in training


def test_math_verify_env_scores_in_a_two_rank_ppo_run(tiny_model_dir, rl_data, tmp_path):
    """math-verify called directly in a sync reward_fn, in a 2-rank PPO run: right answers 1, wrong
    ones 0, no env error. The model is random, so the row's question carries what is graded."""
    env_file = write(tmp_path, "math_env.py", """
from math_verify import parse, verify


def reward_fn(messages, answer):
    return float(verify(parse(answer), parse(messages[0]["content"])))
""")
    data = tmp_path / "math.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            claimed = "\\frac{1}{2}" if i % 2 == 0 else "\\frac{2}{3}"
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Show that x = {claimed}. \\boxed{{{claimed}}}"}],
                                "answer": "0.5"}) + "\n")
    save_dir = tmp_path / "run"
    args = _ppo_args(tiny_model_dir, rl_data, str(save_dir), f"rollout.env_path={env_file}", f"data.path={data}",
                     "trainer.total_steps=2", "trainer.test_freq=null", "data.prompts_per_rollout=8",
                     "data.responses_per_prompt=2")
    run_torchrun(args)
    rows = read_metrics(str(save_dir / "metrics.jsonl"))
    assert [row["env_errors"] for row in rows] == [0.0, 0.0]
    for row in rows:
        dump = [json.loads(line) for line in open(save_dir / "trajectories" / f"step_{row['step']}.jsonl")]
        assert all(t["reward"] == float("frac{1}{2}" in t["messages"][0]["content"]) for t in dump)
        assert row["reward/mean"] == 0.5


def test_a_run_whose_every_reward_fails_stops_naming_the_exception(tiny_model_dir, rl_data, tmp_path):
    env_file = write(tmp_path, "broken_reward.py", "def reward_fn(messages, answer):\n"
                                                   "    raise KeyError('score')\n")
    save_dir = tmp_path / "run"
    args = _ppo_args(tiny_model_dir, rl_data, str(save_dir), f"rollout.env_path={env_file}",
                     "trainer.total_steps=6", "trainer.test_freq=null", "rollout.max_unscored_steps=2")
    result = run_torchrun(args, check=False)
    assert result.returncode != 0
    assert "no reward could be computed in 2 rollout(s) in a row (rollout.max_unscored_steps=2)" in result.stderr
    assert "broken_reward.py" in result.stderr and "reward_fn raised KeyError: 'score'" in result.stderr
    assert "answer=" in result.stderr  # one sample
    rows = read_metrics(str(save_dir / "metrics.jsonl"))
    assert [row["step"] for row in rows] == [1]  # step 2 raised before it was logged; no step reported reward 0
    assert "reward/mean" not in rows[0] and rows[0]["reward_errors"] == 16
