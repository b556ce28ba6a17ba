"""An env worker process: loads the env file once and runs its sync functions in its main thread,
as a plain script would (`python -m rl2.rollout.env_worker PATH ARGS MEMORY_MB`, started by
`rl2.rollout.env.Env` through a `rl2.tools.worker_pool.WorkerPool`).

Signal-based timeouts (math-verify's `parse` / `verify`, sympy with alarms) work here; a crash, a
hang or a memory blow-up in the user's code ends this process, not the run: the pool replaces it.

Request (pickled): `(function name, args)`, or `("tool:<name>", (arguments,))` for a tool of the file's
`TOOLS`, called with the arguments as keywords. Response: `{"value": result}` or `{"raised": {"exception",
"where", "unavailable"}}` (unavailable: it was `rl2.tools.ToolUnavailable`), each with `"faults"` (the running totals of the module's own pools' faults)
and `"pid"`.
"""

import asyncio
import base64
import faulthandler
import inspect
import os
import pickle
import resource
import sys
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


def call(module: Any, path: str, memory_mb: int, request: tuple[str, tuple], tools: dict[str, Any] | None = None
         ) -> dict:
    """Run one env function (or one of its `tools`) and describe its outcome."""
    name, args = request
    try:
        if name.startswith("tool:"):
            result = (tools or {})[name.removeprefix("tool:")](**args[0])
        else:
            result = getattr(module, name)(*args)
        if inspect.isawaitable(result):  # a plain function returning a coroutine
            result = asyncio.run(_awaited(result))
        pickle.dumps(result)  # fails here, with a message, rather than in the frame writer
        response: dict[str, Any] = {"value": result}
    except Exception as exc:  # the function's, or its value cannot be sent back
        response = {"raised": {"exception": describe_exception(exc, memory_mb), "where": where(exc, path),
                               "unavailable": isinstance(exc, ToolUnavailable)}}
    response["faults"] = module_fault_counts(module)
    response["pid"] = os.getpid()
    return response


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
    serve(lambda request: call(module, path, memory_mb, request, tools), PICKLE)


if __name__ == "__main__":
    main()
