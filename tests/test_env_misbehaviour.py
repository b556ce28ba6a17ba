"""An env file's misbehaviour costs one call and is counted: results of its own classes, a huge tool result,
a leaking function, daemons it starts, and a call that hangs in thread mode (a failing gym env: test_gym_env)."""

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl2.chat.template import render_chat
from rl2.chat.tool_parsers import get_tool_parser
from rl2.engines import SamplingParams
from rl2.rollout.env import Env
from rl2.rollout.multi_turn import ToolCalling, observation_tokens, rollout
from rl2.testing.tiny import build_tiny_tokenizer
from scripted_engine import ScriptedEngine
from test_env_workers import reply, write  # the same conversation and file helpers




# Results of classes the env file defines: the trainer cannot import the module a worker loaded it as.
OWN_CLASSES_ENV = """
from dataclasses import dataclass


class Score(float):
    pass


@dataclass
class Reply:
    role: str
    content: str


def reward_fn(messages, answer):
    return Score(0.75)


def interact(messages):
    return [Reply("tool", "hi")]
"""


def test_results_of_the_env_files_own_classes_are_plain_data_or_a_clear_error(tmp_path):
    path = write(tmp_path, "own_classes_env.py", OWN_CLASSES_ENV)
    with Env(path, workers=1, timeout=20.0) as env:
        (scored,) = env.rewards([reply("x")], ["a"])
        (interacted,) = env.interact([reply("x")])
        (again,) = env.rewards([reply("x")], ["a"])  # the worker is fine
    assert scored.value == 0.75 and type(scored.value) is float and scored.error is None and again.value == 0.75
    assert interacted.value == [] and "interact returned a Reply (a class defined in the env file" in interacted.error


# A tool result far past what fits: 10 MB of text, of which a few hundred tokens are kept.
HUGE_RESULT_ENV = '''
def dump(what: str) -> str:
    """Dump a log.

    Args:
        what: which log
    """
    return "the log says hello world " * 400_000


TOOLS = [dump]


def interact(messages):
    return [{"role": "tool", "content": "the log says hello world " * 400_000}]


def reward_fn(messages, answer):
    return float(len(messages[-1]["content"]) < 100_000)
'''

HUGE_CALL = '<tool_call>\n{"name": "dump", "arguments": {"what": "all"}}\n</tool_call>'


@pytest.mark.parametrize("by", ["tools", "interact"])
def test_a_huge_tool_result_is_cut_to_the_room_left_before_it_is_tokenised(tmp_path, by):
    tokenizer = build_tiny_tokenizer()
    source = HUGE_RESULT_ENV if by == "tools" else HUGE_RESULT_ENV.replace("TOOLS = [dump]", "")
    messages = [{"role": "user", "content": "What do the logs say?"}]
    prompt_ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
    with Env(write(tmp_path, "huge_env.py", source), workers=1, timeout=30.0) as env:
        calling = ToolCalling(get_tool_parser("hermes")) if by == "tools" else None
        engine = ScriptedEngine(tokenizer, lambda text: HUGE_CALL)
        start = time.monotonic()
        (trajectory,) = rollout(engine, env, tokenizer, [{"prompt_ids": prompt_ids, "messages": messages, "answer": ""}],
                                1, SamplingParams(max_new_tokens=64), max_turns=3, max_length=600, tool_calling=calling)
        seconds = time.monotonic() - start
    assert seconds < 5.0, f"the rollout took {seconds:.1f} s"  # 37 s before the cut (2 shared cores)
    assert trajectory.truncated and trajectory.done and len(trajectory.token_ids) == 600 and not trajectory.errors
    tool = trajectory.messages[-1]
    assert tool["role"] == "tool" and 2_000 < len(tool["content"]) < 1_000_000  # cut, and not to less than was seen
    # the tokens kept are those the whole result would have given
    turn_end = trajectory.messages.index(tool)
    reference = [{**tool, "content": "the log says hello world " * 20_000}]
    assistant_end = max(i for i, m in enumerate(trajectory.action_mask) if m == 1) + 1
    expected = observation_tokens(tokenizer, trajectory.token_ids[:assistant_end], trajectory.messages[:turn_end],
                                  reference, True, None)
    assert trajectory.token_ids[assistant_end:] == expected[: 600 - assistant_end]


def test_a_huge_tool_result_per_turn_is_cut_before_the_conversation_is_rendered(tmp_path):
    """Per turn, the next turn's sequence renders the whole conversation: the result is cut before, and the
    sequence, which has no room left, is not begun."""
    tokenizer = build_tiny_tokenizer()
    messages = [{"role": "user", "content": "What do the logs say?"}]
    prompt_ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
    source = HUGE_RESULT_ENV.replace("TOOLS = [dump]", "")
    with Env(write(tmp_path, "huge_env.py", source), workers=1, timeout=30.0) as env:
        start = time.monotonic()
        (trajectory,) = rollout(ScriptedEngine(tokenizer, lambda text: HUGE_CALL), env, tokenizer,
                                [{"prompt_ids": prompt_ids, "messages": messages, "answer": ""}], 1,
                                SamplingParams(max_new_tokens=64), max_turns=3, max_length=600, per_turn=True)
        seconds = time.monotonic() - start
    assert seconds < 5.0, f"the rollout took {seconds:.1f} s"
    assert trajectory.truncated and trajectory.done and not trajectory.errors and trajectory.turns == 1
    assert len(trajectory.messages[-1]["content"]) <= 600 * 32


# A reward function that leaks: each call keeps 40 MB for good.
LEAKING_ENV = """
import os

KEPT = []


def reward_fn(messages, answer):
    KEPT.append(bytearray(40 * 1024 * 1024))
    return float(os.getpid())
"""


def test_a_leaking_reward_fn_gets_a_fresh_worker_not_memory_errors_for_good(tmp_path):
    """Under a 300 MB limit a worker holds 5 leaks at most: it is replaced when it nears the limit (or a call
    runs out of memory), so every call but such a one scores, and the replacements are counted."""
    path = write(tmp_path, "leaking_env.py", LEAKING_ENV)
    with Env(path, workers=1, timeout=20.0, memory_mb=300) as env:
        results = [env.rewards([reply("x")], ["a"])[0] for _ in range(16)]
        faults = env.fault_counts()
    failed = [r.error for r in results if r.error is not None]
    assert len(failed) <= 2 and all("MemoryError" in error for error in failed)
    assert results[-1].error is None and len({r.value for r in results if r.error is None}) >= 3  # fresh workers
    assert faults.get("env_worker_restarts", 0) >= 2


def test_env_workers_are_recycled_after_max_calls(tmp_path):
    path = write(tmp_path, "pid_env.py", "import os\n\n\ndef reward_fn(messages, answer):\n    return float(os.getpid())\n")
    with Env(path, workers=1, timeout=20.0, worker_max_calls=2) as env:
        pids = [env.rewards([reply("x")], ["a"])[0].value for _ in range(5)]
        faults = env.fault_counts()
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
    assert faults["env_worker_recycles"] == 2 and not faults.get("env_worker_restarts")


# A reward function that starts a daemon the classic way: fork, setsid, fork again, the middle one exits.
DAEMON_ENV = """
import ctypes
import os
import signal
import subprocess
import sys
import time


def reward_fn(messages, answer):
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            with open(answer + ".part", "w") as note:
                note.write(str(os.getpid()))
            os.rename(answer + ".part", answer)
            time.sleep(600)
            os._exit(0)
        os._exit(0)
    os.waitpid(child, 0)
    deadline = time.monotonic() + 10
    while not os.path.exists(answer) and time.monotonic() < deadline:  # the daemon has started
        time.sleep(0.01)
    return 1.0
"""


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_ends(daemon: int, outliving: str) -> None:
    """Fail (killing it) unless process `daemon` ends within 10 s; `outliving`: what it must not outlive."""
    deadline = time.monotonic() + 10
    while running(daemon):
        if time.monotonic() > deadline:
            os.kill(daemon, signal.SIGKILL)
            pytest.fail(f"the daemon pid {daemon} outlived {outliving}")
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper is Linux's")
def test_a_daemon_a_reward_fn_started_dies_with_its_env(tmp_path):
    path = write(tmp_path, "daemon_env.py", DAEMON_ENV)
    note = tmp_path / "daemon.pid"
    with Env(path, workers=1, timeout=20.0) as env:
        assert env.rewards([reply("x")], [str(note)])[0].value == 1.0
        daemon = int(note.read_text())
        assert running(daemon)
    assert_ends(daemon, "its env")


HANGING_ENV = """
import ctypes


def reward_fn(messages, answer):
    ctypes.CDLL(None).sleep(1000)  # hung in C: no Python code runs, nothing but a kill stops it
    return 1.0
"""

THREAD_MODE_SCRIPT = """
import sys
from rl2.config import RolloutConfig
from rl2.rollout.env import Env

env = Env.from_config(RolloutConfig(env_path=sys.argv[1], env_workers=0, env_timeout=1.0))
(result,) = env.rewards([[{"role": "assistant", "content": "x"}]], ["a"])
print("error:", result.error, flush=True)
{close}
"""


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "not closed"])
def test_thread_mode_exits_despite_a_call_hung_in_c(tmp_path, closed):
    """In thread mode a hung call cannot be stopped (start-up says so) but it no longer holds the process at exit."""
    path = write(tmp_path, "hanging_env.py", HANGING_ENV)
    script = write(tmp_path, "run.py", THREAD_MODE_SCRIPT.replace("{close}", "env.close()" if closed else ""))
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, script, path], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit 30 s after its call hung")
    assert done.returncode == 0, done.stderr
    assert "error: reward_fn timed out after 1.0s" in done.stdout and time.monotonic() - start < 30
    assert "cannot be stopped there" in done.stderr  # the start-up warning


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper is Linux's")
def test_a_daemon_dies_with_a_worker_that_exits_on_its_own(tmp_path):
    """A reward_fn that starts a daemon and then exits its worker (sys.exit): the worker takes the daemon with it."""
    path = write(tmp_path, "daemon_env.py", DAEMON_ENV.replace("    return 1.0", "    raise SystemExit(3)"))
    note = tmp_path / "daemon.pid"
    with Env(path, workers=1, timeout=20.0) as env:
        (result,) = env.rewards([reply("x")], [str(note)])
        assert "crashed its env worker process" in result.error and "exited with code 3" in result.error
        daemon = int(note.read_text())
        assert_ends(daemon, "its worker")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a subreaper is Linux's")
@pytest.mark.parametrize("death", ["os._exit(3)", "os.kill(os.getpid(), signal.SIGKILL)", "ctypes.string_at(0)",
                                   "killed from outside"])
def test_a_daemon_dies_with_a_worker_that_dies_abruptly(tmp_path, death):
    """A worker that dies without running its own clean-up (os._exit, SIGKILL, a segfault, the OOM killer's kill)
    cannot kill its daemons itself: its guard, their subreaper, does, and the pool hears how the worker ended."""
    if death == "killed from outside":
        body = "    time.sleep(600)\n    return 1.0"
    else:
        body = f"    {death}\n    return 1.0"
    source = DAEMON_ENV.replace("    return 1.0", body)
    path = write(tmp_path, "daemon_env.py", source)
    note = tmp_path / "daemon.pid"
    with Env(path, workers=1, timeout=60.0) as env, ThreadPoolExecutor(max_workers=1) as thread:
        call = thread.submit(env.rewards, [reply("x")], [str(note)])
        deadline = time.monotonic() + 30
        while not note.exists():
            assert time.monotonic() < deadline and not call.done(), "the daemon did not start"
            time.sleep(0.01)
        daemon = int(note.read_text())
        if death == "killed from outside":
            [worker] = env._worker_pool.busy_pids()
            with open(f"/proc/{worker}/cmdline") as cmdline:
                assert "rl2.rollout.env_worker" in cmdline.read()  # the worker itself, not its guard
            os.kill(worker, signal.SIGKILL)
        (result,) = call.result(timeout=60)
        ended = {"os._exit(3)": "exited with code 3", "ctypes.string_at(0)": "killed by signal 11 (SIGSEGV)"}
        assert "crashed its env worker process" in result.error
        assert ended.get(death, "killed by signal 9 (SIGKILL)") in result.error
        assert_ends(daemon, f"its worker ({death})")
