"""Loading an env file: the user's Python file with `reward_fn` (and `interact`, `roc_penalty`).

The file runs as a fresh module under a name of its own, with its settings as the global
`env_args`. Its folder is importable while it loads, after the installed packages: a file named
like a package it imports (`gem.py` doing `import gem.wrappers`, `math_verify.py`) gets the
package, not itself. A broken file (missing, syntax or import error, a missing function, RL2's
newer `env_step` / `generate` interface) raises `EnvError` with a message that says what to do.
"""

import importlib.machinery
import importlib.util
import inspect
import os
import sys
import traceback
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable, Iterator

from rl2.config.env_interface import rl2_sample_interface
from rl2.tools.faults import FaultCounter
from rl2.tools.lazy import Lazy

# The packages of the `tools` extra (setup.py) that rl2.tools imports: a missing one gets an install hint.
TOOLS_EXTRA_MODULES = ("aiohttp", "bm25s", "math_verify", "sympy", "pylatexenc")
PORTING_HINT = (
    "rl2 keeps RL2's earlier interface: reward_fn(messages, answer) -> float and, for tools, "
    "interact(messages) -> list of new messages (docs/migration/from-rl2.md shows a port)"
)


class EnvError(Exception):
    """A broken env file: missing, unloadable, or without the functions the run needs."""


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


def load_env_file(path: str, args: EnvArgs | None = None, modules: dict[str, Any] | None = None) -> Any:
    """Execute the env file as a fresh module, with its folder importable (after the installed
    packages) while it loads and its settings as the global `env_args`. `modules` are importable under
    their names while it loads (RL2 HEAD's `RL2.datasets` for its env files: `rl2.rollout.rl2_head_rollout`);
    without them a file written to RL2 HEAD's interface is refused."""
    if not os.path.isfile(path):
        raise EnvError(f"env file not found: {path}")
    if modules is None:
        _refuse_rl2_sample_interface(path)
    modules = modules or {}
    shadowed = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        return _load(path, args)
    finally:
        for name, module in shadowed.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _load(path: str, args: EnvArgs | None) -> Any:
    name = f"rl2_env_{os.path.splitext(os.path.basename(path))[0]}_{uuid.uuid4().hex[:8]}"
    # An explicit loader so a file without the .py suffix still loads.
    loader = importlib.machinery.SourceFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    module.env_args = args if args is not None else EnvArgs({}, path)
    sys.modules[name] = module  # some code (e.g. @dataclass) looks its module up while it loads
    directory = os.path.dirname(os.path.abspath(path))
    sys.path.append(directory)  # last: its helper modules import, but never shadow an installed package
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
        raise EnvError(f"env file {path} failed to load{where(exc, path)}: "
                       f"{type(exc).__name__}: {one_line(str(exc))}{_import_hint(exc, path)}") from exc
    finally:
        sys.path.remove(directory)
        _forget_self_imports(path)
    return module


def env_function(module: Any, path: str, name: str, params: tuple[str, ...], required: bool) -> Callable | None:
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


def module_fault_counts(module: Any) -> dict[str, int]:
    """Running totals of the faults an env module's pools and clients recovered from: the `faults`
    counters of its module-level `Lazy` values that have been made, and its module-level
    `FaultCounter`s, summed by name."""
    totals: Counter[str] = Counter()
    for value in vars(module).values():
        if isinstance(value, Lazy):
            value = value.peek()
        faults = value if isinstance(value, FaultCounter) else getattr(value, "faults", None)
        if isinstance(faults, FaultCounter):
            totals.update(faults.counts())
    return dict(totals)


def close_lazy_values(module: Any) -> None:
    """Close the env module's `Lazy` pools (its sandbox, its grader processes)."""
    for value in vars(module).values():
        if isinstance(value, Lazy):
            value.close()


def where(exc: BaseException, path: str) -> str:
    """' (at FILE:LINE)' for the innermost traceback frame in the env file's folder (the file or
    its helpers), or ''."""
    directory = os.path.dirname(os.path.abspath(path))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.dirname(os.path.abspath(f.filename)) == directory]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def describe_exception(exc: BaseException, memory_mb: int = 0) -> str:
    """`Type: message` on one line (a MemoryError under a memory limit says so)."""
    message = one_line(str(exc))
    if isinstance(exc, MemoryError) and memory_mb > 0:
        message = f"past the env worker's memory limit ({memory_mb} MB, rollout.env_worker_memory_mb) {message}".strip()
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def one_line(text: str, limit: int = 500) -> str:
    """`text` on one line, cut to about `limit` characters."""
    return shorten(" ".join(text.split()), limit)


def shorten(text: str, limit: int = 300) -> str:
    """`text` cut to about `limit` characters, keeping its start and (mostly) its end."""
    if len(text) <= limit:
        return text
    head = limit // 3
    tail = limit - head
    return f"{text[:head]}...[{len(text) - limit} chars]...{text[-tail:]}"


# ----------------------------------------------------------------------------------------------
# what a failed load means


def _refuse_rl2_sample_interface(path: str) -> None:
    """An env file written for RL2's interface since Oct 2025 loaded as one of rl2's: say what it is
    before running it (its `from RL2.datasets import ...` would only fail with a missing module)."""
    found = rl2_sample_interface(path)
    if found is None:
        return
    raise EnvError(
        f"env file {path} is written for RL2's interface since Oct 2025 (it {found}: async env_step(sample) "
        f"returning next_state / reward / done, run by generate = partial(base_generate, env_step_fn=...)), "
        f"which rl2's RL trainer runs as it is (rollout.env_path) but this command does not. {PORTING_HINT}"
    )


def _import_hint(exc: BaseException, path: str) -> str:
    """Why an import failed, where we can tell: an extra to install, RL2 itself, or a file named
    like the package it imports."""
    if not isinstance(exc, ImportError):
        return ""
    missing = (getattr(exc, "name", None) or "").split(".")[0]
    own_name = os.path.splitext(os.path.basename(path))[0]
    if missing in TOOLS_EXTRA_MODULES:
        return " (rl2.tools needs the tools extra: pip install 'rl2[tools]')"
    if missing == "RL2":
        return (f" (rl2's RL2 package holds only what RL2's env files import: RL2.datasets, "
                f"RL2.utils.communication, RL2.trainer; {PORTING_HINT})")
    if own_name and own_name in str(exc) and "is not a package" in str(exc):
        return (f" (the env file is named like the package it imports, {own_name!r}, which is not installed: "
                f"install it, or rename the file)")
    return ""


def _forget_self_imports(path: str) -> None:
    """Drop modules that are the env file itself imported under another name (`import gem` inside
    `gem.py` when no package `gem` is installed), so a later import finds the real package."""
    target = os.path.abspath(path)
    for name, module in list(sys.modules.items()):
        filename = getattr(module, "__file__", None)
        if filename and os.path.abspath(filename) == target and not name.startswith("rl2_env_"):
            del sys.modules[name]
