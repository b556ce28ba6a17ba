"""The user's environment: a Python file with a reward function and, for multi-turn rollouts, an
interaction step.

An env file (`rollout.env_path`) defines

    def reward_fn(messages: list[dict], answer) -> float: ...    # required
    def interact(messages: list[dict]) -> list[dict]: ...        # required when rollout.max_turns > 1

`messages` is the whole conversation so far (ending with the assistant's last message) and `answer`
the dataset row's answer. `interact` returns the messages to append, usually
`{"role": "tool", "content": ...}`; an empty list ends the trajectory. Either may be `async def`.

A broken file (missing, syntax or import error, missing function) raises `EnvError` at start-up.
At run time a call that raises, times out or returns the wrong type does not stop training: it has
no reward (value None; for `interact`, the trajectory ends), a warning with the sample is logged
and the caller gets the error in `EnvResult.error` to count it and to leave the trajectory out of
training. "Could not score" is never turned into a plausible reward such as 0.0.

The file's settings come from `rollout.env_args` through the global `env_args` it sees while it loads
and after (`env_args.get("python_tool_workers", 4)`, falling back to the environment variable
`PYTHON_TOOL_WORKERS`), so a run's config holds them all.

Worker pools and clients an env file keeps at module level (in a `rl2.tools.lazy.Lazy`, or a bare
`rl2.tools.faults.FaultCounter`) report the faults they recovered from through `fault_counts()`.

Sync functions run in a thread pool owned by the `Env`; async ones run on an event loop made for
each batch, so an async env should not keep loop-bound objects (e.g. an HTTP client session)
across calls. A sync call that times out cannot be killed: its thread keeps running and holds a
worker until the function returns.
"""

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import importlib.machinery
import importlib.util
import inspect
import logging
import math
import numbers
import os
import sys
import threading
import traceback
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from rl2.coroutines import run_coroutine
from rl2.tools.faults import FaultCounter
from rl2.tools.lazy import Lazy

logger = logging.getLogger(__name__)

LOG_CHARS = 300  # how much of a message / answer a warning shows
# The packages of the `tools` extra (setup.py) that rl2.tools imports: a missing one gets an install hint.
TOOLS_EXTRA_MODULES = ("aiohttp", "bm25s", "math_verify", "sympy", "pylatexenc")


class EnvError(Exception):
    """A broken env file: missing, unloadable, or without the functions the run needs."""


@dataclass
class EnvResult:
    """The outcome of one env call: the value to use and, if the call failed, why."""

    value: Any  # float reward (None when the call failed), or list[dict] of new messages
    error: str | None  # None when the call succeeded; else a one-line description


class Env:
    """A loaded env file whose `reward_fn` / `interact` are called a batch at a time.

    Each batch call runs all its calls concurrently (at most `concurrency` at once), each with a
    `timeout` in seconds, and returns results in input order. Use it as a context manager or call
    `close()` to shut the worker threads down.
    """

    def __init__(
        self,
        path: str,
        timeout: float = 60.0,
        concurrency: int = 64,
        need_interact: bool = False,
        args: dict[str, Any] | None = None,
    ):
        if timeout <= 0:
            raise ValueError(f"env timeout must be positive, got {timeout}")
        if concurrency < 1:
            raise ValueError(f"env concurrency must be at least 1, got {concurrency}")
        self.path = os.path.expanduser(path)
        self.timeout = float(timeout)
        self.concurrency = concurrency

        module = _load_module(self.path, EnvArgs(args or {}, self.path))
        self._reward_fn = _get_function(module, self.path, "reward_fn", ("messages", "answer"), required=True)
        self._interact = _get_function(module, self.path, "interact", ("messages",), required=need_interact)
        self.has_interact = self._interact is not None
        self._roc_penalty = _get_function(module, self.path, "roc_penalty", ("messages",), required=False)
        self.has_roc_penalty = self._roc_penalty is not None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="rl2-env")
        self._closed = False
        self._module = module

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
    def interactions(self) -> Iterator[Callable[[list[dict]], "concurrent.futures.Future[EnvResult]"]]:
        """A function that starts one `interact(messages)` call and returns a future of its
        `EnvResult`, for a rollout that takes each trajectory's next turn as soon as its tool
        answers. The calls run concurrently (at most `concurrency` at once) on an event loop of
        their own, in a thread, until the block ends; calls still running then are cancelled."""
        if not self.has_interact:
            raise EnvError(f"env file {self.path} does not define interact(messages)")
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="rl2-env-interact", daemon=True)
        thread.start()

        async def make_semaphore() -> asyncio.Semaphore:
            return asyncio.Semaphore(self.concurrency)  # made on the loop it binds to

        semaphore = asyncio.run_coroutine_threadsafe(make_semaphore(), loop).result()

        async def one(messages: list[dict]) -> EnvResult:
            async with semaphore:
                return await self._call("interact", self._interact, (messages,))

        def submit(messages: list[dict]) -> "concurrent.futures.Future[EnvResult]":
            return asyncio.run_coroutine_threadsafe(one(messages), loop)

        async def cancel_the_rest() -> None:
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            yield submit
        finally:
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    def roc_penalties(self, conversations: list[list[dict]]) -> list[EnvResult]:
        """The env file's `roc_penalty(messages)` for each conversation (GRPO-RoC); an error where a
        call failed (the caller falls back to the default penalty)."""
        if not self.has_roc_penalty:
            raise EnvError(f"env file {self.path} does not define roc_penalty(messages)")
        return self._run_batch("roc_penalty", self._roc_penalty, [(messages,) for messages in conversations])

    def fault_counts(self) -> dict[str, int]:
        """Running totals of the faults the env file's pools and clients recovered from (a worker
        replaced, a call retried): the `faults` counters of its module-level `Lazy` values that have
        been made, and its module-level `FaultCounter`s, summed by name."""
        totals: Counter[str] = Counter()
        for value in vars(self._module).values():
            if isinstance(value, Lazy):
                value = value.peek()
            faults = value if isinstance(value, FaultCounter) else getattr(value, "faults", None)
            if isinstance(faults, FaultCounter):
                totals.update(faults.counts())
        return dict(totals)

    def close(self) -> None:
        """Shut the worker threads down, and close the env file's `Lazy` pools (its sandbox, its
        grader processes: trainers end with `os._exit`, which would leave them running). Calls still
        running (hung after a timeout) are not waited for."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for value in vars(self._module).values():
            if isinstance(value, Lazy):
                value.close()

    def __enter__(self) -> "Env":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        def kind(fn: Callable | None) -> str:
            return "none" if fn is None else "async" if _is_async(fn) else "sync"

        return (f"Env({self.path!r}, reward_fn={kind(self._reward_fn)}, interact={kind(self._interact)}, "
                f"timeout={self.timeout}, concurrency={self.concurrency}{', closed' if self._closed else ''})")

    # ------------------------------------------------------------------------------------------
    # calling

    def _run_batch(self, name: str, fn: Callable, calls: list[tuple]) -> list[EnvResult]:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        return run_coroutine(lambda: self._gather(name, fn, calls))

    async def _gather(self, name: str, fn: Callable, calls: list[tuple]) -> list[EnvResult]:
        semaphore = asyncio.Semaphore(self.concurrency)  # made here: it binds to this batch's loop

        async def one(args: tuple) -> EnvResult:
            async with semaphore:
                return await self._call(name, fn, args)

        return list(await asyncio.gather(*(one(args) for args in calls)))

    async def _call(self, name: str, fn: Callable, args: tuple) -> EnvResult:
        """One call with a timeout and a checked result; failures become (default value, error):
        None for a number, [] (end of the trajectory) for messages."""
        numeric = name in ("reward_fn", "roc_penalty")
        default = None if numeric else []
        note = ""
        try:
            result, exc = await asyncio.wait_for(self._invoke(fn, copy.deepcopy(args)), self.timeout)
        except asyncio.TimeoutError:  # only ours: the function's own exceptions come back in `exc`
            error = f"{name} timed out after {self.timeout}s"
            if not _is_async(fn):
                note = " (a sync function cannot be stopped: its thread keeps running)"
        else:
            if exc is not None:
                error = f"{name} raised {type(exc).__name__}: {_one_line(str(exc))}"
                note = _where(exc, self.path)
            else:
                value, problem = _check_reward(result) if numeric else _check_messages(result)
                if problem is None:
                    return EnvResult(value, None)
                error = f"{name} {problem}"

        sample = f"answer={_shorten(repr(args[1]))}; " if name == "reward_fn" else ""
        logger.warning("env %s: %s%s; %slast message: %s", self.path, error, note, sample, _describe_last(args[0]))
        return EnvResult(default, error)

    async def _invoke(self, fn: Callable, args: tuple) -> tuple[Any, Exception | None]:
        """(result, None), or (None, exception) when the function raised."""
        try:
            if _is_async(fn):
                return await fn(*args), None
            result = await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
            if inspect.isawaitable(result):  # e.g. a plain function returning a coroutine
                result = await result
            return result, None
        except Exception as exc:
            return None, exc


# ----------------------------------------------------------------------------------------------
# loading


class EnvArgs(Mapping):
    """`rollout.env_args` as an env file sees them: the global `env_args` of the file.

    `env_args.get(name, default)` is the setting `name` from the config, else the environment variable
    `NAME` (upper case; how settings were passed before `rollout.env_args`), else `default`; a value
    from the environment is converted to the type of `default`, with an error naming the variable.
    A file that must also import on its own starts with
    `env_args = globals().get("env_args", EnvArgs())`.
    """

    def __init__(self, args: dict[str, Any] | None = None, path: str = "env file"):
        self._args = dict(args or {})
        self._path = path

    def __getitem__(self, name: str) -> Any:
        return self._args[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._args)

    def __len__(self) -> int:
        return len(self._args)

    def get(self, name: str, default: Any = None) -> Any:
        if name in self._args:
            return self._args[name]
        value = os.environ.get(name.upper())
        if value is None or value.strip() == "":
            return default
        if default is None or isinstance(default, str):
            return value
        kind = type(default)
        try:
            return kind(value) if kind is not bool else value.strip().lower() in ("1", "true", "yes")
        except ValueError:
            raise ValueError(
                f"{self._path}: environment variable {name.upper()}={value!r} is not a {kind.__name__} "
                f"(or set rollout.env_args.{name})"
            ) from None


def _load_module(path: str, args: EnvArgs | None = None) -> Any:
    """Execute the env file as a fresh module, with its directory importable while it loads and its
    settings as the global `env_args`."""
    if not os.path.isfile(path):
        raise EnvError(f"env file not found: {path}")
    name = f"rl2_env_{os.path.splitext(os.path.basename(path))[0]}_{uuid.uuid4().hex[:8]}"
    # An explicit loader so a file without the .py suffix still loads.
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    module.env_args = args if args is not None else EnvArgs({}, path)
    sys.modules[name] = module  # some code (e.g. @dataclass) looks its module up while it loads
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        filename = exc.filename if exc.filename and os.path.abspath(exc.filename) != os.path.abspath(path) else path
        text = f"\n    {exc.text.strip()}" if exc.text and exc.text.strip() else ""
        loading = "" if filename == path else f" (imported by env file {path})"
        raise EnvError(f"syntax error in {filename}, line {exc.lineno}: {exc.msg}{loading}{text}") from exc
    except Exception as exc:
        sys.modules.pop(name, None)
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name in TOOLS_EXTRA_MODULES:
            hint = " (rl2.tools needs the tools extra: pip install 'rl2[tools]')"
        raise EnvError(f"env file {path} failed to load{_where(exc, path)}: "
                       f"{type(exc).__name__}: {_one_line(str(exc))}{hint}") from exc
    finally:
        sys.path.remove(directory)
    return module


def _get_function(module: Any, path: str, name: str, params: tuple[str, ...], required: bool) -> Callable | None:
    """`module.<name>`, checked to be callable with `params`; None when absent and not required."""
    signature = f"{name}({', '.join(params)})"
    fn = getattr(module, name, None)
    if fn is None:
        if required:
            why = " (needed because rollout.max_turns > 1)" if name == "interact" else ""
            raise EnvError(f"env file {path} does not define {signature}{why}")
        return None
    if not callable(fn):
        raise EnvError(f"env file {path}: {name} must be a function {signature}, got {type(fn).__name__}")
    try:
        parameters = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; nothing to check
        return fn
    try:
        parameters.bind(*params)
    except TypeError:
        raise EnvError(f"env file {path}: {name}{parameters} cannot be called as {signature}") from None
    return fn


# ----------------------------------------------------------------------------------------------
# helpers


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
    """(messages, None) for a list of {"role": str, "content": str, ...} dicts; else ([], problem)."""
    if not isinstance(value, (list, tuple)):
        return [], f"returned {type(value).__name__}, expected a list of messages"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return [], f"returned a list whose item {i} is {type(message).__name__}, expected a dict"
        for key in ("role", "content"):
            if key not in message:
                return [], f"returned a message (item {i}) without {key!r}"
            if not isinstance(message[key], str):
                return [], f"returned a message (item {i}) whose {key!r} is {type(message[key]).__name__}, expected str"
    # A copy, so messages the function keeps (e.g. a constant list) never alias the trajectory.
    return copy.deepcopy(list(value)), None


def _where(exc: BaseException, path: str) -> str:
    """' (at FILE:LINE)' for the innermost traceback frame in the env file's directory (the file or
    its helpers), or ''."""
    directory = os.path.dirname(os.path.abspath(path))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.dirname(os.path.abspath(f.filename)) == directory]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _one_line(text: str) -> str:
    return _shorten(" ".join(text.split()), 500)


def _shorten(text: str, limit: int = LOG_CHARS) -> str:
    """`text` cut to about `limit` characters, keeping its start and (mostly) its end."""
    if len(text) <= limit:
        return text
    head = limit // 3
    tail = limit - head
    return f"{text[:head]}...[{len(text) - limit} chars]...{text[-tail:]}"


def _describe_last(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        return "(none)"
    last = messages[-1]
    if not isinstance(last, dict):
        return _shorten(repr(last))
    content = last.get("content")
    return f"{last.get('role')}: {_shorten(content if isinstance(content, str) else repr(content))!r}"
