"""An env worker process: loads the env file once and runs its sync functions in its main thread,
as a plain script would (`python -m rl2.rollout.env_worker PATH ARGS MEMORY_MB`, started by
`rl2.rollout.env.Env` through a `rl2.tools.worker_pool.WorkerPool`).

Signal-based timeouts (math-verify's `parse` / `verify`, sympy with alarms) work here; a crash, a
hang or a memory blow-up in the user's code ends this process, not the run: the pool replaces it.

Request (pickled): `(function name, args)`, or `("tool:<name>", (arguments,))` for a tool of the file's
`TOOLS`, called with the arguments as keywords. Response: `{"value": result}` or `{"raised": {"exception",
"where", "unavailable"}}` (unavailable: it was `rl2.tools.ToolUnavailable`) or `{"returned": what}` (a value
that cannot leave the worker as plain data), each with `"faults"` (the running totals of the module's own pools'
faults) and `"pid"`, and `"retire"` (why) when this worker should be replaced after the call: the call ran out
of memory, or this process holds more than `MEMORY_CEILING` of the room its memory limit left after the file
loaded (a function that leaks would fail every later call with MemoryError).

Values cross the process boundary as plain data (`plain_data`): a subclass of a builtin type (`class Score(float)`)
becomes that type, and a value whose class is defined in the env file (a result dataclass) is refused with a
description, since the trainer cannot import the module the worker loaded the file as.
"""

import asyncio
import base64
import faulthandler
import inspect
import io
import json
import os
import pickle
import resource
import sys
import types
from typing import Any

from rl2.chat.tools import tool_functions
from rl2.tools import ToolUnavailable
from rl2.rollout.env_file import EnvArgs, EnvError, describe_exception, load_env_file, module_fault_counts, where
from rl2.tools.worker_pool import PICKLE, serve


def encode_args(args: dict[str, Any]) -> str:
    """`rollout.env_args` as one command-line argument."""
    return base64.b64encode(pickle.dumps(args)).decode()


def limit_memory(megabytes: int) -> None:
    """Cap this process's data segment (heap and private mappings, where numpy and Python allocate):
    past it an allocation raises MemoryError in the call that made it."""
    if megabytes > 0:
        limit = megabytes * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


MEMORY_CEILING = 0.75  # of the room the memory limit leaves after the file loaded: past it the worker is replaced


def data_bytes() -> int:
    """This process's data segment (what RLIMIT_DATA limits), in bytes; 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[5]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return 0


def past_memory_ceiling(memory_mb: int, loaded_bytes: int) -> bool:
    """Whether this process uses more than `MEMORY_CEILING` of the room `memory_mb` left after loading."""
    if memory_mb <= 0:
        return False
    room = memory_mb * 1024 * 1024 - loaded_bytes
    return data_bytes() - loaded_bytes > MEMORY_CEILING * room


def call(module: Any, path: str, memory_mb: int, request: tuple[str, tuple], tools: dict[str, Any] | None = None,
         loaded_bytes: int = 0) -> dict:
    """Run one env function (or one of its `tools`) and describe its outcome."""
    response = _outcome(module, path, memory_mb, request, tools)
    if response.pop("out_of_memory", False):
        response["retire"] = "the call ran out of memory"
    elif past_memory_ceiling(memory_mb, loaded_bytes):
        response["retire"] = (f"it holds {data_bytes() // 2**20} MB, past {MEMORY_CEILING:.0%} of its room under "
                              f"its memory limit ({memory_mb} MB, rollout.env_worker_memory_mb)")
    response["faults"] = module_fault_counts(module)
    response["pid"] = os.getpid()
    return response


def _outcome(module: Any, path: str, memory_mb: int, request: tuple[str, tuple], tools: dict[str, Any] | None) -> dict:
    """The call's value or why there is none (`out_of_memory`: it raised MemoryError)."""
    name, args = request
    try:
        if name.startswith("tool:"):
            result = (tools or {})[name.removeprefix("tool:")](**args[0])
        else:
            result = getattr(module, name)(*args)
        if inspect.isawaitable(result):  # a plain function returning a coroutine
            result = asyncio.run(_awaited(result))
        try:
            result = plain_data(result, module.__name__)
        except NotPlainData:
            if not name.startswith("tool:"):
                raise
            result = json.dumps(result, ensure_ascii=False, default=str)  # a tool's message is its value as JSON
        _EnvClassCheck(io.BytesIO(), module.__name__).dump(result)  # fails here, with a message, not in the frame writer
        response: dict[str, Any] = {"value": result}
    except NotPlainData as problem:
        response = {"returned": str(problem)}
    except Exception as exc:  # the function's, or its value cannot be sent back
        response = {"raised": {"exception": describe_exception(exc, memory_mb), "where": where(exc, path),
                               "unavailable": isinstance(exc, ToolUnavailable)},
                    "out_of_memory": isinstance(exc, MemoryError)}
    return response


class NotPlainData(TypeError):
    """A value holds an object of a class defined in the env file; the message says which."""


def plain_data(value: Any, module_name: str) -> Any:
    """`value` as data the trainer can unpickle: a subclass of a builtin scalar or container becomes
    that type (`class Score(float)` a float, a namedtuple a tuple), through lists, tuples and dicts.
    `NotPlainData` for an object of a class of the env module `module_name` (a dataclass of its own)."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, dict):
        return {plain_data(key, module_name): plain_data(item, module_name) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain_data(item, module_name) for item in value]
        return items if isinstance(value, list) else tuple(items)
    for kind in (bool, float, int, str, bytes):  # a subclass (numpy.float64 too): its value
        if isinstance(value, kind):
            return kind(value)
    if type(value).__module__ == module_name:
        raise NotPlainData(_not_plain(type(value)))
    return value


class _EnvClassCheck(pickle.Pickler):
    """Pickles a value, raising `NotPlainData` at any object, class or function of the env module
    (deeper than `plain_data` looks: in a set, an attribute): the trainer could not unpickle it."""

    def __init__(self, file: io.BytesIO, module_name: str):
        super().__init__(file)
        self.module_name = module_name

    def reducer_override(self, obj: Any) -> Any:
        for kind in (type(obj), obj):
            if isinstance(kind, (type, types.FunctionType)) and getattr(kind, "__module__", None) == self.module_name:
                raise NotPlainData(_not_plain(kind))
        return NotImplemented


def _not_plain(kind: Any) -> str:
    what = "class" if isinstance(kind, type) else "function"
    return (f"a {kind.__qualname__} (a {what} defined in the env file, which cannot leave its env worker process): "
            "return plain data (numbers, str, lists, dicts)")


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def main() -> None:
    path, args, memory_mb = sys.argv[1], pickle.loads(base64.b64decode(sys.argv[2])), int(sys.argv[3])
    faulthandler.enable()  # a segfault in user code prints where it happened (the pool quotes it)
    limit_memory(memory_mb)
    try:
        module = load_env_file(path, EnvArgs(args, path))
        tools = tool_functions(getattr(module, "TOOLS", None))
    except EnvError as error:
        sys.exit(f"rl2 env worker: {error}")
    loaded_bytes = data_bytes()
    serve(lambda request: call(module, path, memory_mb, request, tools, loaded_bytes), PICKLE)


if __name__ == "__main__":
    main()
