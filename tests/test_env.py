"""Env files: loading errors at start-up, concurrent calls, and run-time errors that do not stop a run,
with sync functions in env worker processes (the default) and in threads (`workers=0`)."""

import asyncio
import logging
import os
import sys
import time

import pytest

from rl2.rollout.env import Env, EnvError, EnvResult

ENVS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "envs")


def env_path(name: str) -> str:
    return os.path.join(ENVS, name)


def chat(last: str, role: str = "assistant") -> list[dict]:
    return [{"role": "user", "content": "question"}, {"role": role, "content": last}]


def write_env(tmp_path, source: str, name: str = "env.py") -> str:
    path = tmp_path / name
    path.write_text(source)
    return str(path)


# Where sync functions run: threads of this process, or env worker processes.
MODES = [pytest.param(0, id="threads"), pytest.param(2, id="processes")]


def env_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rl2.rollout.env" and r.levelno == logging.WARNING]


# ----------------------------------------------------------------------------------------------
# working envs


@pytest.mark.parametrize("workers", MODES)
@pytest.mark.parametrize("name", ["good_sync.py", "good_async.py"])
def test_rewards_in_input_order(name, workers):
    with Env(env_path(name), workers=workers) as env:
        results = env.rewards([chat("4"), chat("5"), chat("x"), chat("7")], ["4", 4, "y", 7])
    assert results == [EnvResult(1.0, None), EnvResult(0.0, None), EnvResult(0.0, None), EnvResult(1.0, None)]
    assert all(type(r.value) is float for r in results)


@pytest.mark.parametrize("workers", MODES)
@pytest.mark.parametrize("name", ["good_sync.py", "good_async.py"])
def test_interact_in_input_order(name, workers):
    with Env(env_path(name), need_interact=True, workers=workers) as env:
        assert env.has_interact
        results = env.interact([chat("a"), chat("bye"), chat("c")])
    assert [r.error for r in results] == [None, None, None]
    assert [[m["content"] for m in r.value] for r in results] == [["echo: a"], [], ["echo: c"]]
    assert results[0].value[0]["role"] == "tool"


@pytest.mark.parametrize("workers", MODES)
def test_extra_message_keys_kept(workers):
    with Env(env_path("good_sync.py"), workers=workers) as env:
        [result] = env.interact([chat("a")])
    assert result.value == [{"role": "tool", "content": "echo: a", "tool_call_id": "call-1"}]


@pytest.mark.parametrize("name, workers", [("slow_sync.py", 0), ("slow_async.py", 0), ("slow_sync.py", 8)])
def test_calls_run_concurrently(name, workers):
    # 8 calls of 0.3 s each: one after another would take 2.4 s.
    with Env(env_path(name), concurrency=8, workers=workers) as env:
        env.rewards([chat("a")] * workers, [None] * workers)  # the workers' start-up is not what is timed
        start = time.perf_counter()
        rewards = env.rewards([chat("a")] * 8, [None] * 8)
        reward_seconds = time.perf_counter() - start
        start = time.perf_counter()
        steps = env.interact([chat("a")] * 8)
        interact_seconds = time.perf_counter() - start
    assert [r.value for r in rewards] == [1.0] * 8
    assert [r.value for r in steps] == [[{"role": "tool", "content": "done"}]] * 8
    assert reward_seconds < 1.0 and interact_seconds < 1.0


@pytest.mark.parametrize("name, workers", [("slow_async.py", 0), ("slow_sync.py", 4)])
def test_concurrency_is_bounded(name, workers):
    # concurrency=2: 4 calls of 0.3 s need two rounds (also with more env workers than that).
    with Env(env_path(name), concurrency=2, workers=workers) as env:
        start = time.perf_counter()
        env.rewards([chat("a")] * 4, [None] * 4)
        assert time.perf_counter() - start >= 0.55


@pytest.mark.parametrize("name, workers", [("slow_sync.py", 0), ("slow_async.py", 0), ("slow_sync.py", 3)])
def test_interactions_one_call_at_a_time(name, workers):
    """`interactions()` starts calls one by one (futures of EnvResult), concurrently, bounded by
    `concurrency`; errors come back as results; calls still running at the end are cancelled."""
    with Env(env_path(name), concurrency=3, need_interact=True, workers=workers) as env:
        env.interact([chat("a")] * workers)  # the workers' start-up is not what is timed
        with env.interactions() as interact:
            start = time.perf_counter()
            futures = [interact(chat("a")) for _ in range(6)]  # 0.3 s each, 3 at once: two rounds
            results = [future.result(timeout=5) for future in futures]
            elapsed = time.perf_counter() - start
            left_running = interact(chat("a"))
        assert left_running.cancelled()
    assert results == [EnvResult([{"role": "tool", "content": "done"}], None)] * 6
    assert 0.55 <= elapsed < 1.5


@pytest.mark.parametrize("workers", MODES)
def test_interactions_report_errors_and_need_interact(tmp_path, workers):
    path = write_env(tmp_path, "def reward_fn(messages, answer):\n    return 0.0\n"
                               "def interact(messages):\n    raise ValueError('no tool here')\n")
    with Env(path, workers=workers) as env:
        with env.interactions() as interact:
            result = interact(chat("a")).result(timeout=5)
    assert result.value == [] and result.error == "interact raised ValueError: no tool here"
    with Env(env_path("reward_only.py")) as env:
        with pytest.raises(EnvError, match="defines neither interact"):
            with env.interactions():
                pass


@pytest.mark.parametrize("workers", MODES)
def test_reward_types_converted(tmp_path, workers):
    numpy = pytest.importorskip("numpy")
    path = write_env(tmp_path, "import numpy\n\ndef reward_fn(messages, answer):\n    return eval(answer)\n")
    with Env(path, workers=workers) as env:
        results = env.rewards([chat("a")] * 5, ["True", "3", "numpy.float32(0.5)", "numpy.int64(-2)", "0.25"])
    assert [r.value for r in results] == [1.0, 3.0, 0.5, -2.0, 0.25]
    assert all(type(r.value) is float and r.error is None for r in results)
    assert numpy  # used by the env file


@pytest.mark.parametrize("workers", MODES)
def test_helper_module_in_env_directory(workers):
    path_before = list(sys.path)
    with Env(env_path("uses_helper.py"), workers=workers) as env:
        results = env.rewards([chat("so the answer is 42"), chat("it is 41")], [42, 42])
    assert [r.value for r in results] == [1.0, 0.0]
    assert sys.path == path_before


@pytest.mark.parametrize("workers", [0, 1])
def test_each_env_is_a_fresh_module(tmp_path, workers):
    source = "CALLS = []\n\ndef reward_fn(messages, answer):\n    CALLS.append(1)\n    return float(len(CALLS))\n"
    path = write_env(tmp_path, source)
    with Env(path, workers=workers) as first, Env(path, workers=workers) as second:
        assert first.rewards([chat("a")], [None])[0].value == 1.0
        assert first.rewards([chat("a")], [None])[0].value == 2.0
        assert second.rewards([chat("a")], [None])[0].value == 1.0


@pytest.mark.parametrize("workers", MODES)
def test_messages_passed_are_copies(workers):
    conversation = chat("original")
    answer = ["keep"]
    with Env(env_path("mutating.py"), workers=workers) as env:
        [reward] = env.rewards([conversation], [answer])
        first = env.interact([conversation])[0].value
        first[0]["content"] = "mutated by the trainer"
        second = env.interact([conversation])[0].value
    assert reward == EnvResult(1.0, None)
    assert conversation == chat("original") and answer == ["keep"]
    assert second == [{"role": "tool", "content": "shared"}]


def test_works_inside_a_running_event_loop():
    # A notebook cell runs inside an event loop, where asyncio.run() would refuse to start.
    async def notebook_cell() -> tuple[list[EnvResult], list[EnvResult]]:
        with Env(env_path("good_sync.py")) as sync_env, Env(env_path("good_async.py")) as async_env:
            return sync_env.rewards([chat("1"), chat("2")], ["1", "1"]), async_env.interact([chat("a")])

    rewards, steps = asyncio.run(notebook_cell())
    assert [r.value for r in rewards] == [1.0, 0.0]
    assert steps[0].value == [{"role": "tool", "content": "echo: a"}]


def test_repr_close_and_context_manager():
    env = Env(env_path("good_async.py"), timeout=5, concurrency=3, workers=0)
    text = repr(env)
    assert "good_async.py" in text and "reward_fn=async" in text and "timeout=5.0" in text and "concurrency=3" in text
    assert "threads" in text and env.mode == "threads"
    assert "workers=3" in repr(Env(env_path("good_sync.py"), workers=3))
    with env:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        env.rewards([chat("a")], [None])


def test_mismatched_lengths_rejected():
    with Env(env_path("good_sync.py")) as env, pytest.raises(ValueError, match="2 conversations but 1 answers"):
        env.rewards([chat("a"), chat("b")], ["a"])


# ----------------------------------------------------------------------------------------------
# start-up errors


def test_missing_file():
    with pytest.raises(EnvError, match="not found.*no_such_env.py"):
        Env(env_path("no_such_env.py"))


def test_syntax_error_names_file_and_line():
    with pytest.raises(EnvError) as info:
        Env(env_path("broken_syntax.py"))
    assert "broken_syntax.py" in str(info.value) and "line 3" in str(info.value)


def test_missing_reward_fn():
    with pytest.raises(EnvError, match=r"no_reward.py does not define reward_fn\(messages, answer\)"):
        Env(env_path("no_reward.py"))


def test_interact_required_only_when_asked():
    env = Env(env_path("reward_only.py"))
    assert not env.has_interact and "interact=none" in repr(env)
    with pytest.raises(EnvError, match="does not define interact"):
        env.interact([chat("a")])
    env.close()
    with pytest.raises(EnvError, match=r"reward_only.py does not define interact\(messages\).*max_turns"):
        Env(env_path("reward_only.py"), need_interact=True)


def test_reward_fn_not_callable(tmp_path):
    with pytest.raises(EnvError, match="reward_fn must be a function.*got float"):
        Env(write_env(tmp_path, "reward_fn = 1.0\n"))


def test_reward_fn_wrong_signature(tmp_path):
    with pytest.raises(EnvError, match=r"reward_fn\(messages\) cannot be called as reward_fn\(messages, answer\)"):
        Env(write_env(tmp_path, "def reward_fn(messages):\n    return 1.0\n"))


def test_import_error_in_env_file():
    with pytest.raises(EnvError) as info:
        Env(env_path("bad_import.py"))
    message = str(info.value)
    assert "bad_import.py" in message and "ModuleNotFoundError" in message and "rl2_no_such_module_for_tests" in message
    assert not any(name.startswith("rl2_env_bad_import") for name in sys.modules)


def test_env_args_reach_the_env_file_before_the_environment(tmp_path, monkeypatch):
    env_file = tmp_path / "configured.py"
    env_file.write_text("WORKERS = env_args.get('tool_workers', 4)\n"
                        "def reward_fn(messages, answer):\n"
                        "    return float(env_args.get('bonus', 0.5)) + WORKERS\n")
    monkeypatch.setenv("BONUS", "0.25")
    with Env(str(env_file), args={"tool_workers": 8}) as env:  # a config value wins over the variable
        assert env.rewards([chat("a")], [None])[0].value == 8.25  # the variable, as the default's type
    monkeypatch.setenv("TOOL_WORKERS", "2")
    with Env(str(env_file)) as env:
        assert env.rewards([chat("a")], [None])[0].value == 2.25
    monkeypatch.setenv("TOOL_WORKERS", "many")
    with pytest.raises(EnvError, match=r"TOOL_WORKERS='many' is not a int \(or set rollout.env_args.tool_workers\)"):
        Env(str(env_file))


def test_a_missing_tools_extra_package_gets_an_install_hint(tmp_path):
    env_file = tmp_path / "needs_bm25s.py"
    env_file.write_text("raise ModuleNotFoundError(\"No module named 'bm25s'\", name='bm25s')\n"
                        "def reward_fn(messages, answer):\n    return 0.0\n")
    with pytest.raises(EnvError, match=r"needs_bm25s.py.*No module named 'bm25s'.*pip install 'rl2\[tools\]'"):
        Env(str(env_file))
    with pytest.raises(EnvError) as info:  # any other missing module: no hint
        Env(env_path("bad_import.py"))
    assert "rl2[tools]" not in str(info.value)


# ----------------------------------------------------------------------------------------------
# run-time errors


@pytest.mark.parametrize("workers", MODES)
def test_reward_fn_raises(caplog, workers):
    with Env(env_path("misbehaving.py"), workers=workers) as env:
        results = env.rewards([chat("a"), chat("b" * 5000), chat("c")], ["ok", "raise", "ok"])
    assert results[0] == results[2] == EnvResult(1.0, None)
    assert results[1] == EnvResult(None, "reward_fn raised ValueError: no reward for you")
    [warning] = env_warnings(caplog)
    assert "misbehaving.py" in warning and "reward_fn raised ValueError" in warning and "answer='raise'" in warning
    assert "bbbb" in warning and len(warning) < 1000  # the 5000-character message is shortened


@pytest.mark.parametrize("answer, error", [
    ("str", "reward_fn returned str, expected a number"),
    ("none", "reward_fn returned NoneType, expected a number"),
    ("nan", "reward_fn returned nan, expected a finite number"),
])
@pytest.mark.parametrize("workers", MODES)
def test_reward_fn_wrong_type(caplog, answer, error, workers):
    with Env(env_path("misbehaving.py"), workers=workers) as env:
        results = env.rewards([chat("a"), chat("a")], [answer, "bool"])
    assert results == [EnvResult(None, error), EnvResult(1.0, None)]
    [warning] = env_warnings(caplog)
    assert "misbehaving.py" in warning and error in warning


@pytest.mark.parametrize("name, workers, note", [
    ("misbehaving.py", 0, "keeps running"),
    ("misbehaving_async.py", 0, None),
    ("misbehaving.py", 2, "its env worker process was killed and replaced"),
])
def test_reward_fn_timeout(caplog, name, workers, note):
    with Env(env_path(name), timeout=0.2, workers=workers) as env:
        env.rewards([chat("a")] * workers, ["ok"] * workers)  # the workers' start-up is not what is timed
        start = time.perf_counter()
        results = env.rewards([chat("a"), chat("a")], ["sleep", "ok"])
        assert time.perf_counter() - start < 0.8
    assert results == [EnvResult(None, "reward_fn timed out after 0.2s"), EnvResult(1.0, None)]
    [warning] = env_warnings(caplog)
    assert name in warning and "timed out" in warning
    if note is None:
        assert "keeps running" not in warning and "killed" not in warning
    else:
        assert note in warning


def test_async_reward_fn_raises(caplog):
    with Env(env_path("misbehaving_async.py")) as env:
        results = env.rewards([chat("a"), chat("a")], ["raise", "ok"])
    assert results == [EnvResult(None, "reward_fn raised RuntimeError: async failure"), EnvResult(1.0, None)]
    [warning] = env_warnings(caplog)
    assert "misbehaving_async.py" in warning


@pytest.mark.parametrize("kind, error", [
    ("raise", "interact raised KeyError: 'tool'"),
    ("dict", "interact returned dict, expected a list of messages"),
    ("no content", "interact returned a message (item 0) without 'content'"),
    ("int content", "interact returned a message (item 0) whose 'content' is int, expected str"),
    ("str item", "interact returned a list whose item 0 is str, expected a dict"),
])
@pytest.mark.parametrize("workers", MODES)
def test_interact_errors_end_the_trajectory(caplog, kind, error, workers):
    with Env(env_path("misbehaving.py"), need_interact=True, workers=workers) as env:
        results = env.interact([chat(kind), chat("fine")])
    assert results == [EnvResult([], error), EnvResult([{"role": "tool", "content": "ok"}], None)]
    [warning] = env_warnings(caplog)
    assert "misbehaving.py" in warning and error in warning and repr(kind) in warning


def test_interact_tuple_accepted():
    with Env(env_path("misbehaving.py")) as env:
        [result] = env.interact([chat("tuple")])
    assert result == EnvResult([{"role": "tool", "content": "ok"}], None)


@pytest.mark.parametrize("name, workers", [("misbehaving.py", 0), ("misbehaving_async.py", 0), ("misbehaving.py", 2)])
def test_interact_timeout(name, workers):
    with Env(env_path(name), timeout=0.2, workers=workers) as env:
        env.interact([chat("fine")] * workers)  # the workers' start-up is not what is timed
        start = time.perf_counter()
        results = env.interact([chat("sleep"), chat("fine")])
        assert time.perf_counter() - start < 0.8
    assert results == [EnvResult([], "interact timed out after 0.2s"), EnvResult([{"role": "tool", "content": "ok"}], None)]


@pytest.mark.parametrize("workers", MODES)
def test_users_own_timeout_error_is_not_our_timeout(tmp_path, workers):
    path = write_env(tmp_path, "def reward_fn(messages, answer):\n    raise TimeoutError('http request')\n")
    with Env(path, timeout=5, workers=workers) as env:
        [result] = env.rewards([chat("a")], [None])
    assert result == EnvResult(None, "reward_fn raised TimeoutError: http request")


def test_close_closes_the_env_files_lazy_pools(tmp_path):
    """Trainers end with os._exit: an env file's worker pools (made through `Lazy`) must be closed
    by `Env.close`, or their processes outlive the run (and hold its output pipes open)."""
    path = tmp_path / "pooled_env.py"
    path.write_text(
        "from rl2.tools.lazy import Lazy\n\n"
        "class Pool:\n"
        "    closed = 0\n"
        "    def close(self):\n"
        "        Pool.closed += 1\n\n"
        "_pool = Lazy(Pool)\n"
        "_unused = Lazy(Pool)\n\n"
        "def reward_fn(messages, answer):\n"
        "    _pool.get()\n"
        "    return 1.0\n"
    )
    env = Env(str(path), workers=0)
    assert [r.value for r in env.rewards([[{"role": "assistant", "content": "x"}]], [None])] == [1.0]
    module = env._module
    env.close()
    assert module.Pool.closed == 1  # the pool that was made; the unused one was never started
    assert module._pool._value is None


# ----------------------------------------------------------------------------------------------
# recovered faults


def test_fault_counts_sum_the_env_files_pools_and_counters(tmp_path):
    path = tmp_path / "pools.py"
    path.write_text(
        "from rl2.tools.faults import FaultCounter\n"
        "from rl2.tools.lazy import Lazy\n"
        "class Pool:\n"
        "    def __init__(self):\n"
        "        self.faults = FaultCounter()\n"
        "pool = Lazy(Pool)\n"
        "unused = Lazy(Pool)\n"
        "counter = FaultCounter()\n"
        "def reward_fn(messages, answer):\n"
        "    pool.get().faults.add('worker_restarts', 2)\n"
        "    counter.add('worker_restarts')\n"
        "    counter.add('call_retries')\n"
        "    return 1.0\n"
    )
    with Env(str(path), workers=0) as env:
        assert env.fault_counts() == {}  # nothing made, nothing counted
        env.rewards([chat("a"), chat("b")], ["x", "y"])
        assert env.fault_counts() == {"worker_restarts": 6, "call_retries": 2}
