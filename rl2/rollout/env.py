"""The user's environment: a Python file with a reward function and, for multi-turn rollouts, an
interaction step, called a batch at a time.

An env file (`rollout.env_path`) defines

    def reward_fn(messages: list[dict], answer) -> float: ...    # required
    def interact(messages: list[dict]) -> list[dict]: ...        # required when rollout.max_turns > 1 without TOOLS
    TOOLS = [search, python]                                      # native function calling (rl2.chat.tools)

`messages` is the whole conversation so far (ending with the assistant's last message) and `answer`
the dataset row's answer. `interact` returns the messages to append, usually
`{"role": "tool", "content": ...}`; an empty list ends the trajectory. Either may be `async def`.
With `TOOLS` (functions with type hints and docstrings, see `rl2.chat.tools`) the model calls them in its
own format (`rollout.tool_parser`, or the file's `parse_tool_calls(text)`); each call runs as a sync
function runs below, with `rollout.tool_timeout`; what the model got wrong comes back to it as the tool's
message, what the infrastructure got wrong (`rl2.tools.ToolUnavailable`) is an env error.
Loading (and what a broken file gets) is `rl2.rollout.env_file`.

Where the functions run:
- sync functions, by default, in env worker processes (`rollout.env_workers`; `rl2.rollout.env_worker`),
  each loading the file once and calling in its main thread, as a plain script would: signal-based
  libraries work (math-verify's `parse` / `verify`), CPU-heavy functions use the cores, and a crash,
  a hang past the timeout (its worker is killed and replaced) or a memory blow-up costs one call;
- sync functions with `workers=0`, in threads of the trainer process (shared in-process state; a
  timed-out call cannot be stopped there and keeps its thread, a daemon one, so it never holds the exit);
- async functions on an event loop in the trainer process.

At run time a call that raises, times out, crashes its worker or returns the wrong type does not stop
training: it has no reward (value None; for `interact`, the trajectory ends), a warning with the
sample is logged and the caller gets the error in `EnvResult.error` to count it and to leave the
trajectory out of training. "Could not score" is never turned into a plausible reward such as 0.0.

The file's settings come from `rollout.env_args` through the global `env_args` it sees while it loads
and after (`env_args.get("python_tool_workers", 4)`, falling back to the environment variable
`PYTHON_TOOL_WORKERS`), so a run's config holds them all. Worker pools and clients an env file keeps
at module level (in a `rl2.tools.lazy.Lazy`, or a bare `rl2.tools.faults.FaultCounter`) report the
faults they recovered from through `fault_counts()`, from every process the file runs in.
"""

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import inspect
import json
import logging
import math
import numbers
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from PIL import Image

from rl2.chat.tools import Tool, ToolUnavailable, argument_problem, environment_tools, tools_from_entries
from rl2.config import RolloutConfig
from rl2.coroutines import run_coroutine
from rl2.rollout.daemon_threads import DaemonThreadExecutor
from rl2.rollout.gym_env import GymCallFailed, GymEpisode
from rl2.rollout.env_file import (  # noqa: F401  (EnvArgs, EnvError: env files and callers import them from here)
    EnvArgs,
    EnvError,
    close_lazy_values,
    describe_exception,
    env_function,
    load_env_file,
    module_fault_counts,
    one_line,
    shorten,
    where,
)
from rl2.rollout.env_worker import encode_args
from rl2.tools.worker_pool import PICKLE, WorkerFailed, WorkerPool, WorkerTimeout, child_python_environment

logger = logging.getLogger(__name__)

MAX_AUTO_WORKERS = 8  # env workers per rank when rollout.env_workers is unset
WORKER_START_TIMEOUT = 120.0  # seconds an env worker may take to import its env file


def default_env_workers() -> int:
    """Env worker processes per rank when `rollout.env_workers` is unset: this rank's share of the
    cores it may use (torchrun's LOCAL_WORLD_SIZE ranks share them), at least 1, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(MAX_AUTO_WORKERS, cores // max(ranks_here, 1)))


@dataclass
class EnvResult:
    """The outcome of one env call: the value to use and, if the call failed, why."""

    value: Any  # float reward (None when the call failed), or list[dict] of new messages
    error: str | None  # None when the call succeeded; else a one-line description


@dataclass
class _Outcome:
    """What one call gave before its value is checked: a value, or why there is none."""

    value: Any = None
    error: str | None = None
    note: str = ""  # more for the log: where in the env file, what became of a hung call
    unavailable: bool = False  # the call could not run for want of infrastructure (ToolUnavailable, pool closed)


@dataclass
class ToolResult:
    """The outcome of one tool call: the text of its tool message, and what went wrong, if anything."""

    content: str | list[dict]  # text, or content parts with images (`tool_text`)
    error: str | None = None  # the model's mistake (unknown tool, bad arguments, the tool raised or timed out): still a message
    env_error: str | None = None  # the infrastructure's: no message, the trajectory ends and is left out of training
    seconds: float = 0.0


class Interactions:
    """Calls into the env file one at a time, each a future, on an event loop of the env's own (`Env.interactions`):
    `interactions(messages)` for `interact`, `interactions.call_tools(calls)` for the tool calls of a turn."""

    def __init__(self, env: "Env", loop: asyncio.AbstractEventLoop, semaphore: asyncio.Semaphore):
        self.env, self.loop, self.semaphore = env, loop, semaphore

    def __call__(self, messages: list[dict]) -> "concurrent.futures.Future[EnvResult]":
        async def one() -> EnvResult:
            async with self.semaphore:
                return await self.env._call("interact", self.env._interact, (messages,))

        return asyncio.run_coroutine_threadsafe(one(), self.loop)

    def call_tools(self, calls: list[tuple[str, dict]], instance: Any = None
                   ) -> "concurrent.futures.Future[list[ToolResult]]":
        """The results of `(tool name, arguments)` calls (on `instance`, a trajectory's stateful
        environment), run concurrently, in order."""
        async def one(name: str, arguments: dict) -> ToolResult:
            async with self.semaphore:
                return await self.env.call_tool(name, arguments, instance)

        async def every() -> list[ToolResult]:
            return list(await asyncio.gather(*(one(name, arguments) for name, arguments in calls)))

        return asyncio.run_coroutine_threadsafe(every(), self.loop)

    def step(self, instance: Any, text: str) -> "concurrent.futures.Future[EnvResult]":
        """A gym-style environment's `step` on a turn's text (`rl2.rollout.gym_env`): the next messages,
        [] once the episode is done; a failure is an env error."""
        async def one() -> EnvResult:
            async with self.semaphore:
                outcome = await self.env._call_here("step", instance.step, (text,))
                return self.env._checked("step", ([{"role": "assistant", "content": text}],), outcome)

        return asyncio.run_coroutine_threadsafe(one(), self.loop)


class Env:
    """A loaded env file whose `reward_fn` / `interact` / `roc_penalty` are called a batch at a time.

    Each batch call runs all its calls concurrently (at most `concurrency` at once), each with a
    `timeout` in seconds, and returns results in input order. `workers`: env worker processes for
    the sync functions (None: `default_env_workers()`; 0: threads in this process), each limited to
    `memory_mb` of memory (0: no limit) and replaced after `worker_max_calls` calls (0: never) or when
    one runs out of memory or nears its limit; they start at the first sync call. Use it as a context
    manager or call `close()` to stop the workers.
    """

    def __init__(
        self,
        path: str,
        timeout: float = 60.0,
        concurrency: int = 64,
        need_interact: bool = False,
        args: dict[str, Any] | None = None,
        workers: int | None = None,
        memory_mb: int = 8192,
        tool_timeout: float | None = None,
        step_discount: float = 1.0,
        worker_max_calls: int = 1000,
    ):
        if timeout <= 0:
            raise ValueError(f"env timeout must be positive, got {timeout}")
        if concurrency < 1:
            raise ValueError(f"env concurrency must be at least 1, got {concurrency}")
        if workers is not None and workers < 0:
            raise ValueError(f"env workers must be >= 0 (0 = threads), got {workers}")
        if worker_max_calls < 0:
            raise ValueError(f"env worker_max_calls must be >= 0 (0 = never), got {worker_max_calls}")
        self.path = os.path.expanduser(path)
        self.timeout = float(timeout)
        self.concurrency = concurrency
        self.workers = default_env_workers() if workers is None else workers
        self.memory_mb = memory_mb
        self.worker_max_calls = worker_max_calls
        self._args = dict(args or {})

        module = load_env_file(self.path, EnvArgs(self._args, self.path))
        self.environment_factory = getattr(module, "ENVIRONMENT", None)
        make_env = env_function(module, self.path, "make_env", ("row",), required=False)
        if make_env is not None and self.environment_factory is not None:
            raise EnvError(f"env file {self.path} defines both ENVIRONMENT and make_env: give one of them")
        self.steps_environment = make_env is not None  # gym-style: step(text) after each turn
        if make_env is not None:
            self.environment_factory = functools.partial(GymEpisode, make_env, step_discount)
        scores_itself = self.environment_factory is not None and (
            make_env is not None or hasattr(self.environment_factory, "reward"))
        self._reward_fn = env_function(module, self.path, "reward_fn", ("messages", "answer"), required=not scores_itself)
        self.scores_with_environment = self._reward_fn is None  # its stateful environments' reward()
        self.tools = env_tools(module, self.path)
        self.has_tools = bool(self.tools)
        self.tool_timeout = float(tool_timeout or timeout)
        self._interact = env_function(module, self.path, "interact", ("messages",),
                                      required=need_interact and not self.has_tools and not self.steps_environment)
        self.has_interact = self._interact is not None
        self.parse_tool_calls = env_function(module, self.path, "parse_tool_calls", ("text",), required=False)
        self._roc_penalty = env_function(module, self.path, "roc_penalty", ("messages",), required=False)
        self.has_roc_penalty = self._roc_penalty is not None
        self._threads = DaemonThreadExecutor(concurrency, thread_name_prefix="rl2-env")  # a hung call never holds the exit
        self._closed = False
        self._module = module
        self._worker_pool: WorkerPool | None = None
        self._dispatch_threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._worker_lock = threading.Lock()  # guards the pool's start and the workers' fault totals
        self._worker_faults: dict[int, dict[str, int]] = {}  # worker pid -> its module's fault totals

    @classmethod
    def from_config(cls, rollout: RolloutConfig, need_interact: bool = False, step_discount: float = 1.0) -> "Env":
        """The env file of `rollout.env_path` with the run's env settings (`step_discount`: a gym-style
        environment's step rewards discounted by it, `adv.gamma`)."""
        if rollout.env_workers == 0 and os.environ.get("RANK", "0") == "0":
            logger.warning("env %s: rollout.env_workers=0 runs its sync functions in threads of this process: a call "
                           "that hangs (in C) cannot be stopped there, only abandoned at its timeout, and a crash or "
                           "a memory blow-up ends the run; env workers (the default) contain them", rollout.env_path)
        return cls(rollout.env_path, timeout=rollout.env_timeout, concurrency=rollout.env_concurrency,
                   need_interact=need_interact, args=rollout.env_args, workers=rollout.env_workers,
                   memory_mb=rollout.env_worker_memory_mb, tool_timeout=rollout.tool_timeout,
                   step_discount=step_discount, worker_max_calls=rollout.env_worker_max_calls)

    @property
    def mode(self) -> str:
        """Where sync functions run: 'processes' or 'threads'."""
        return "processes" if self.workers > 0 else "threads"

    def rewards(self, conversations: list[list[dict]], answers: list[Any]) -> list[EnvResult]:
        """`reward_fn(messages, answer)` for each pair; value None where a call failed."""
        if len(conversations) != len(answers):
            raise ValueError(f"{len(conversations)} conversations but {len(answers)} answers")
        calls = [(messages, answer) for messages, answer in zip(conversations, answers)]
        return self._run_batch("reward_fn", self._reward_fn, calls)

    def interact(self, conversations: list[list[dict]]) -> list[EnvResult]:
        """`interact(messages)` for each conversation; value [] (trajectory ends) where a call failed."""
        if not self.has_interact:
            raise EnvError(f"env file {self.path} does not define interact(messages)")
        return self._run_batch("interact", self._interact, [(messages,) for messages in conversations])

    @contextlib.contextmanager
    def interactions(self) -> Iterator[Interactions]:
        """`Interactions`: starts one `interact(messages)` call (or a turn's tool calls) and returns a
        future of its `EnvResult` (`ToolResult`s), for a rollout that takes each trajectory's next turn as
        soon as its tools answer. The calls run concurrently (at most `concurrency` at once) on an event
        loop of their own, in a thread, until the block ends; calls still running then are cancelled."""
        if not (self.has_interact or self.has_tools or self.steps_environment):
            raise EnvError(f"env file {self.path} defines neither interact(messages), TOOLS nor make_env")
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="rl2-env-interact", daemon=True)
        thread.start()

        async def make_semaphore() -> asyncio.Semaphore:
            return asyncio.Semaphore(self.concurrency)  # made on the loop it binds to

        semaphore = asyncio.run_coroutine_threadsafe(make_semaphore(), loop).result()

        async def cancel_the_rest() -> None:
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            yield Interactions(self, loop, semaphore)
        finally:
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    async def call_tool(self, name: str, arguments: dict, instance: Any = None) -> ToolResult:
        """Run one call of the tool `name` (in an env worker if it is sync, as `reward_fn` runs; on
        `instance`, a trajectory's stateful environment, in this process), within `tool_timeout`; an
        unknown name or arguments that do not fit its schema are the model's mistake."""
        tool = self.tools.get(name)
        if tool is None:
            error = f"there is no tool named {name!r} (the tools are: {', '.join(self.tools)})"
            return ToolResult(f"Error: {error}", error=f"unknown tool {name!r}")
        problem = argument_problem(tool, arguments)
        if problem is not None:
            return ToolResult(f"Error: {problem}", error=problem)
        start = time.perf_counter()
        function = tool.bound(instance)
        if instance is None and self._in_workers(function):
            outcome = await asyncio.get_running_loop().run_in_executor(
                self._dispatcher(), self._call_worker, f"tool:{name}", (arguments,), self.tool_timeout)
        else:
            outcome = await self._call_here(f"tool {name}", _keyword_call(function), (arguments,), self.tool_timeout)
        seconds = time.perf_counter() - start
        if outcome.error is None:
            return ToolResult(tool_text(outcome.value), seconds=seconds)
        error = outcome.error.replace(f"tool:{name}", name).replace(f"tool {name}", name)
        if outcome.unavailable:
            logger.warning("env %s: tool %s could not run: %s%s", self.path, name, error, outcome.note)
            return ToolResult("", env_error=f"tool {name}: {error}", seconds=seconds)
        return ToolResult(f"Error: {error}", error=error, seconds=seconds)

    def start_environments(self, rows: list[dict]) -> list[EnvResult]:
        """A stateful environment for each row (`ENVIRONMENT()`, then `reset(**row)`), in this process:
        value (instance, the observation `reset` returned or None), or the error."""
        async def start(row: dict) -> tuple[Any, Any]:
            instance = await self._in_thread(self.environment_factory)
            reset = getattr(instance, "reset", None)
            observation = None if reset is None else await self._in_thread(reset, **row)
            messages = isinstance(observation, list) and all(isinstance(m, dict) for m in observation)
            if observation is not None and not isinstance(observation, str) and not messages:
                raise TypeError(f"reset returned {type(observation).__name__}, expected a str, messages or None")
            return instance, observation

        return self._run_in_process("reset", start, [(row,) for row in rows])

    def environment_rewards(self, instances: list[Any]) -> list[EnvResult]:
        """Each stateful environment's `reward()`; value None where a call failed."""
        async def reward(instance: Any) -> Any:
            return await self._in_thread(instance.reward)

        results = self._run_in_process("reward", reward, [(instance,) for instance in instances])
        return [EnvResult(*_check_reward(r.value)) if r.error is None else r for r in results]

    def close_environments(self, instances: list[Any]) -> None:
        """Call each stateful environment's `close()` where it has one; a failure is logged, not raised."""
        for instance in instances:
            close = getattr(instance, "close", None)
            try:
                if close is not None:
                    result = close()
                    if inspect.isawaitable(result):
                        run_coroutine(lambda: result)
            except Exception as exc:  # noqa: BLE001 - closing must not fail the step
                _, exc = _what_raised("close", exc)
                logger.warning("env %s: close() of a stateful environment raised %s", self.path,
                               describe_exception(exc))

    async def _in_thread(self, function: Callable, *args, **kwargs) -> Any:
        """`function(*args, **kwargs)`: awaited if async, else in one of this process's threads."""
        if _is_async(function):
            return await function(*args, **kwargs)
        result = await asyncio.get_running_loop().run_in_executor(self._threads, lambda: function(*args, **kwargs))
        return await result if inspect.isawaitable(result) else result

    def _run_in_process(self, name: str, coroutine_fn: Callable, calls: list[tuple]) -> list[EnvResult]:
        """`coroutine_fn(*args)` for each call on an event loop in this process, each within `timeout`;
        errors as `EnvResult.error`."""
        async def one(args: tuple) -> EnvResult:
            try:
                return EnvResult(await asyncio.wait_for(coroutine_fn(*args), self.timeout), None)
            except asyncio.TimeoutError:
                return EnvResult(None, f"{name} timed out after {self.timeout}s")
            except Exception as exc:
                function, exc = _what_raised(name, exc)
                error = f"{function} raised {describe_exception(exc)}"
                logger.warning("env %s: %s%s", self.path, error, where(exc, self.path))
                return EnvResult(None, error)

        async def every() -> list[EnvResult]:
            return list(await asyncio.gather(*(one(args) for args in calls)))

        return run_coroutine(every) if calls else []

    def roc_penalties(self, conversations: list[list[dict]]) -> list[EnvResult]:
        """The env file's `roc_penalty(messages)` for each conversation (GRPO-RoC); an error where a
        call failed (the caller falls back to the default penalty)."""
        if not self.has_roc_penalty:
            raise EnvError(f"env file {self.path} does not define roc_penalty(messages)")
        return self._run_batch("roc_penalty", self._roc_penalty, [(messages,) for messages in conversations])

    def fault_counts(self) -> dict[str, int]:
        """Running totals of the faults recovered from: the env file's own pools and counters in this
        process and in every env worker (`module_fault_counts`), and the env workers replaced
        (`env_worker_restarts`; `env_worker_timeouts` of them for a call past its timeout; and
        `env_worker_recycles`, after `worker_max_calls` calls)."""
        totals: Counter[str] = Counter(module_fault_counts(self._module))
        with self._worker_lock:
            for counts in self._worker_faults.values():
                totals.update(counts)
            if self._worker_pool is not None:
                totals.update(self._worker_pool.faults.counts())
        return dict(totals)

    def close(self) -> None:
        """Stop the env workers and the threads, and close the env file's `Lazy` pools (its sandbox,
        its grader processes: trainers end with `os._exit`, which would leave them running). Calls
        still running (hung after a timeout, in thread mode) are not waited for."""
        self._closed = True
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._worker_lock:
            pool, self._worker_pool = self._worker_pool, None
            dispatch, self._dispatch_threads = self._dispatch_threads, None
        if dispatch is not None:
            dispatch.shutdown(wait=False, cancel_futures=True)
        if pool is not None:
            pool.close()
        close_lazy_values(self._module)

    def __enter__(self) -> "Env":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        def kind(fn: Callable | None) -> str:
            return "none" if fn is None else "async" if _is_async(fn) else "sync"

        where = f"workers={self.workers}" if self.workers else "threads"
        return (f"Env({self.path!r}, reward_fn={kind(self._reward_fn)}, interact={kind(self._interact)}, "
                f"timeout={self.timeout}, concurrency={self.concurrency}, {where}"
                f"{', closed' if self._closed else ''})")

    # ------------------------------------------------------------------------------------------
    # calling

    def _run_batch(self, name: str, fn: Callable, calls: list[tuple]) -> list[EnvResult]:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if self._in_workers(fn):  # no event loop needed: one dispatching thread per env worker
            return list(self._dispatcher().map(lambda args: self._checked(name, args, self._call_worker(name, args)), calls))
        return run_coroutine(lambda: self._gather(name, fn, calls))

    async def _gather(self, name: str, fn: Callable, calls: list[tuple]) -> list[EnvResult]:
        semaphore = asyncio.Semaphore(self.concurrency)  # made here: it binds to this batch's loop

        async def one(args: tuple) -> EnvResult:
            async with semaphore:
                return await self._call(name, fn, args)

        return list(await asyncio.gather(*(one(args) for args in calls)))

    async def _call(self, name: str, fn: Callable, args: tuple) -> EnvResult:
        """One call with a timeout and a checked result."""
        if self._in_workers(fn):  # the pool enforces the timeout from when the call reaches a worker
            outcome = await asyncio.get_running_loop().run_in_executor(self._dispatcher(), self._call_worker, name, args)
        else:
            outcome = await self._call_here(name, fn, args)
        return self._checked(name, args, outcome)

    def _checked(self, name: str, args: tuple, outcome: _Outcome) -> EnvResult:
        """The call's value, checked; failures become (default value, error): None for a number,
        [] (end of the trajectory) for messages, with a warning that shows the sample."""
        numeric = name in ("reward_fn", "roc_penalty")
        if outcome.error is None:
            value, problem = _check_reward(outcome.value) if numeric else _check_messages(outcome.value)
            if problem is None:
                return EnvResult(value, None)
            outcome.error = f"{name} {problem}"
        sample = f"answer={shorten(repr(args[1]))}; " if name == "reward_fn" else ""
        logger.warning("env %s: %s%s; %slast message: %s", self.path, outcome.error, outcome.note, sample,
                       _describe_last(args[0]))
        return EnvResult(None if numeric else [], outcome.error)

    def _in_workers(self, fn: Callable) -> bool:
        return self.workers > 0 and not _is_async(fn)

    async def _call_here(self, name: str, fn: Callable, args: tuple, timeout: float | None = None) -> _Outcome:
        """Call `fn` in this process: on the event loop (async) or in a thread (sync)."""
        timeout = timeout or self.timeout
        try:
            return await asyncio.wait_for(self._invoke(name, fn, copy.deepcopy(args)), timeout)
        except asyncio.TimeoutError:  # only ours: the function's own exceptions come back in the outcome
            note = "" if _is_async(fn) else " (a sync function cannot be stopped in a thread: it keeps running)"
            return _Outcome(error=f"{name} timed out after {timeout}s", note=note)

    async def _invoke(self, name: str, fn: Callable, args: tuple) -> _Outcome:
        try:
            if _is_async(fn):
                return _Outcome(await fn(*args))
            result = await asyncio.get_running_loop().run_in_executor(self._threads, lambda: fn(*args))
            if inspect.isawaitable(result):  # e.g. a plain function returning a coroutine
                result = await result
            return _Outcome(result)
        except Exception as exc:
            name, exc = _what_raised(name, exc)
            return _Outcome(error=f"{name} raised {describe_exception(exc)}", note=where(exc, self.path),
                            unavailable=isinstance(exc, ToolUnavailable))

    def _call_worker(self, name: str, args: tuple, timeout: float | None = None) -> _Outcome:
        """Call the sync function `name` (`tool:<name>` for a tool) in an env worker process (blocking;
        runs in a thread)."""
        timeout = timeout or self.timeout
        try:
            response = self._workers_pool().call((name, args), timeout)
        except WorkerTimeout:
            return _Outcome(error=f"{name} timed out after {timeout}s",
                            note=" (its env worker process was killed and replaced)")
        except WorkerFailed as failure:
            if not failure.how:  # the pool is closed
                return _Outcome(error=f"{name} could not run: {failure}", unavailable=True)
            said = _relevant_lines(failure.stderr_tail, self.path)
            return _Outcome(error=f"{name} crashed its env worker process, which was replaced: it {failure.how}"
                                  + (f"; it wrote: {one_line(' | '.join(said))}" if said else ""))
        with self._worker_lock:
            self._worker_faults[response["pid"]] = response["faults"]
        if "raised" in response:
            raised = response["raised"]
            return _Outcome(error=f"{name} raised {raised['exception']}", note=raised["where"],
                            unavailable=raised.get("unavailable", False))
        if "returned" in response:  # a value of a class of the env file, which the trainer cannot unpickle
            return _Outcome(error=f"{name} returned {response['returned']}")
        return _Outcome(response["value"])

    def _dispatcher(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that hand calls to the env workers and wait for them: one per worker (more
        would only wait for an idle worker), at most `concurrency`."""
        with self._worker_lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._dispatch_threads is None:
                self._dispatch_threads = concurrent.futures.ThreadPoolExecutor(
                    max_workers=min(self.workers, self.concurrency), thread_name_prefix="rl2-env-dispatch")
            return self._dispatch_threads

    def _workers_pool(self) -> WorkerPool:
        """The env worker processes, started at the first call that needs them."""
        with self._worker_lock:
            if self._closed:
                raise WorkerFailed(f"{self!r} is closed")
            if self._worker_pool is None:
                command = [sys.executable, "-m", "rl2.rollout.env_worker", os.path.abspath(self.path),
                           encode_args(self._args), str(self.memory_mb)]
                # retries=0: a call whose worker dies (the user's code crashed it) is not run again.
                self._worker_pool = WorkerPool("env_worker", [command] * self.workers, retries=0,
                                               env=child_python_environment(), start_timeout=WORKER_START_TIMEOUT,
                                               codec=PICKLE, max_calls=self.worker_max_calls)
            return self._worker_pool


# ----------------------------------------------------------------------------------------------
# helpers


def env_tools(module: Any, path: str) -> dict[str, Tool]:
    """The tools of the env file's `TOOLS`, or of its stateful `ENVIRONMENT`'s methods, by name (none
    without either); `EnvError` for a broken entry."""
    tools, environment = getattr(module, "TOOLS", None), getattr(module, "ENVIRONMENT", None)
    try:
        if tools is not None and environment is not None:
            raise ValueError(f"env file {path} defines both TOOLS and ENVIRONMENT: give the tools as functions "
                             "(TOOLS) or as the methods of a stateful environment (ENVIRONMENT), not both")
        if environment is not None:
            return environment_tools(environment, f"env file {path}")
        return {} if tools is None else tools_from_entries(tools, f"env file {path}")
    except ValueError as exc:
        raise EnvError(str(exc)) from None


def tool_text(value: Any) -> str | list[dict]:
    """A tool's return value as its message's content: text as it is; an image (a PIL image) or a list of
    content parts with an image among them as content parts (for a vision-language policy); anything else
    as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, Image.Image):
        return [{"type": "image", "image": value}]
    if _is_parts(value) and any(part["type"] in ("image", "image_url") for part in value):
        return value
    return "" if value is None else json.dumps(value, ensure_ascii=False, default=str)


def _keyword_call(function: Callable) -> Callable:
    """`function` as a function of one argument, the dict of its keyword arguments (async if it is)."""
    if _is_async(function):
        async def call_async(arguments: dict) -> Any:
            return await function(**arguments)
        return call_async
    return lambda arguments: function(**arguments)


def _what_raised(name: str, exc: Exception) -> tuple[str, Exception]:
    """The function of the env file that raised and its exception: a gym-style environment's `make_env`,
    `reset` or `step` (`GymCallFailed`) rather than the call of rl2's that drove it; else `name`, `exc`."""
    if isinstance(exc, GymCallFailed) and isinstance(exc.__cause__, Exception):
        return exc.function, exc.__cause__
    return name, exc


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _check_reward(value: Any) -> tuple[float, str | None]:
    """(reward, None) for a finite real number (bool and numpy scalars included); else (0.0, problem)."""
    if not isinstance(value, numbers.Real):
        return 0.0, f"returned {type(value).__name__}, expected a number"
    reward = float(value)
    if not math.isfinite(reward):
        return 0.0, f"returned {reward}, expected a finite number"
    return reward, None


def _check_messages(value: Any) -> tuple[list[dict], str | None]:
    """(messages, None) for a list of {"role": str, "content": str, ...} dicts, a content also a list of parts
    (dicts with a "type": text and images, for a vision-language policy); else ([], problem)."""
    if not isinstance(value, (list, tuple)):
        return [], f"returned {type(value).__name__}, expected a list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return [], f"returned a list whose item {i} is {type(message).__name__}, expected a dict"
        for key in ("role", "content"):
            if key not in message:
                return [], f"returned a message (item {i}) without {key!r}"
            if key == "content" and _is_parts(message[key]):
                continue
            if not isinstance(message[key], str):
                return [], f"returned a message (item {i}) whose {key!r} is {type(message[key]).__name__}, expected str"
    # A copy, so messages the function keeps (e.g. a constant list) never alias the trajectory.
    return copy.deepcopy(list(value)), None


def _is_parts(content: Any) -> bool:
    """Whether `content` is a list of content parts ({"type": "text" | "image" | "image_url", ...})."""
    return isinstance(content, list) and all(isinstance(part, dict) and "type" in part for part in content)


def _relevant_lines(stderr_tail: list[str], path: str) -> list[str]:
    """Of a dead env worker's last stderr lines: the first (e.g. "Fatal Python error: Segmentation
    fault") and those that name the env file's folder (where in the user's code), else the last three."""
    folder = os.path.dirname(os.path.abspath(path))
    in_env = [line for line in stderr_tail if folder in line]
    if not in_env:
        return stderr_tail[-3:]
    return ([stderr_tail[0]] if stderr_tail[0] not in in_env else []) + in_env


def _describe_last(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        return "(none)"
    last = messages[-1]
    if not isinstance(last, dict):
        return shorten(repr(last))
    content = last.get("content")
    return f"{last.get('role')}: {shorten(content if isinstance(content, str) else repr(content))!r}"
