"""Tools an env file gives the model: Python functions with type hints and a Google-style docstring, whose
JSON schemas come from transformers' `get_json_schema`, or OpenAI-style schemas paired with a callable.

    async def search(query: str, top_k: int = 3) -> str:
        \"\"\"Search Wikipedia.

        Args:
            query: what to look for
            top_k: how many passages
        \"\"\"

    TOOLS = [search, python, ({"type": "function", "function": {...}}, run_sql)]

A call's arguments are checked against its schema (`jsonschema`) before the tool runs.
"""

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import jsonschema

from rl2.tools import ToolUnavailable  # noqa: F401  (tools raise it; it is defined where env files import helpers)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: its name, its OpenAI-style schema and the function that runs it (for a
    stateful environment's tool, the name of the method to call on the trajectory's instance)."""

    name: str
    schema: dict
    function: Callable | str
    validator: Any = field(default=None, compare=False, repr=False)  # of the parameters' JSON schema

    def __post_init__(self):
        parameters = self.schema["function"].get("parameters")
        if parameters and self.validator is None:
            object.__setattr__(self, "validator", jsonschema.validators.validator_for(parameters)(parameters))

    def bound(self, instance: Any = None) -> Callable:
        """The function to call: the tool's own, or the method of `instance`."""
        return getattr(instance, self.function) if isinstance(self.function, str) else self.function



def tools_from_entries(entries: Any, where: str) -> dict[str, Tool]:
    """The tools of an env file's `TOOLS` list, by name, in order; `ValueError` naming the entry (and the
    function) when one has no usable schema."""
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"{where}: TOOLS must be a list of functions (or (schema, function) pairs), "
                         f"got {type(entries).__name__}")
    tools: dict[str, Tool] = {}
    for i, entry in enumerate(entries):
        tool = _tool(entry, f"{where}: TOOLS[{i}]")
        if tool.name in tools:
            raise ValueError(f"{where}: TOOLS[{i}] is a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def tool_functions(entries: Any) -> dict[str, Callable]:
    """The functions of an env file's `TOOLS` by the names their schemas give them, without making the
    schemas (what an env worker process needs to run them; `tools_from_entries` checked them at start-up)."""
    functions = {}
    for entry in entries or ():
        if isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], dict):
            functions[entry[0]["function"]["name"]] = entry[1]
        else:
            functions[getattr(entry, "__name__", type(entry).__name__)] = entry
    return functions


def _tool(entry: Any, where: str) -> Tool:
    if isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], dict):
        schema, function = entry
        if not callable(function):
            raise ValueError(f"{where}: the second item of a (schema, function) pair must be callable, "
                             f"got {type(function).__name__}")
        return Tool(check_schema(schema, where), schema, function)
    if not callable(entry):
        raise ValueError(f"{where}: expected a function or a (schema, function) pair, got {type(entry).__name__}")
    from transformers.utils import get_json_schema  # here: env worker processes need no transformers (~1 s)

    name = getattr(entry, "__name__", type(entry).__name__)
    try:
        schema = get_json_schema(entry)
    except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ValueError(f"{where} ({name}): no JSON schema can be made from its type hints and docstring: {exc} "
                         "(each argument needs a type hint and a line under 'Args:' in a Google-style docstring)"
                         ) from None
    return Tool(schema["function"]["name"], schema, entry)


# Methods of a stateful environment that are not tools: its life cycle and its score.
ENVIRONMENT_METHODS = ("reset", "reward", "close")


def environment_tools(factory: Any, where: str) -> dict[str, Tool]:
    """The tools of a stateful environment (an env file's `ENVIRONMENT`, TRL's `environment_factory` shape):
    its public methods other than reset / reward / close, schemas from their hints and docstrings. Their
    `function` is the method's name: each trajectory calls it on its own instance."""
    if not callable(factory):
        raise ValueError(f"{where}: ENVIRONMENT must be a class (or a function making one instance per trajectory), "
                         f"got {type(factory).__name__}")
    from transformers.utils import get_json_schema

    cls = factory if isinstance(factory, type) else type(factory())
    probe = cls.__new__(cls)  # bound methods for their signatures, without running __init__
    tools: dict[str, Tool] = {}
    for name, member in vars(cls).items():
        if name.startswith("_") or name in ENVIRONMENT_METHODS or not callable(member):
            continue
        method = getattr(probe, name)
        try:
            schema = get_json_schema(method)
        except Exception as exc:
            raise ValueError(f"{where}: ENVIRONMENT's method {name}: no JSON schema can be made from its type hints "
                             f"and docstring: {exc}") from None
        tools[name] = Tool(name, schema, name)
    if not tools:
        raise ValueError(f"{where}: ENVIRONMENT ({cls.__name__}) has no public method to call as a tool")
    return tools


def check_schema(schema: Any, where: str) -> str:
    """The function name of an OpenAI-style tool schema; `ValueError` saying what is missing."""
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(f"{where}: a tool schema must look like "
                         '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}, '
                         f"got {json.dumps(schema, default=str)[:200]}")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{where} ({function['name']}): its parameters are not a valid JSON schema: {exc.message}"
                         ) from None
    return function["name"]


def argument_problem(tool: Tool, arguments: dict) -> str | None:
    """Why `arguments` do not fit the tool's parameters, in words for the model; None when they do."""
    if tool.validator is None:
        return None if not arguments else f"{tool.name} takes no arguments, got {sorted(arguments)}"
    errors = sorted(tool.validator.iter_errors(arguments), key=lambda error: list(error.path))
    if not errors:
        return None
    error = errors[0]
    at = f" (argument {'.'.join(str(p) for p in error.path)})" if error.path else ""
    return f"the arguments of {tool.name} do not match its parameters{at}: {error.message}"


def row_tools(value: Any, tools: dict[str, Tool], where: str) -> list[dict]:
    """The schemas a row's `tools` column gives: OpenAI-style schemas or names of the env's tools, as a
    list or a JSON string; `ValueError` naming the row and the entry."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}, field 'tools': a string that is not JSON ({exc.msg})") from None
    if not isinstance(value, list):
        raise ValueError(f"{where}, field 'tools': expected a list of tool schemas or tool names, "
                         f"got {type(value).__name__}")
    schemas = []
    for i, entry in enumerate(value):
        if isinstance(entry, str):
            if entry not in tools:
                raise ValueError(f"{where}, field 'tools': tools[{i}] names {entry!r}, which the env file's TOOLS "
                                 f"do not define ({', '.join(tools) or 'none'})")
            schemas.append(tools[entry].schema)
        else:
            entry = drop_nulls(entry)  # arrow fills keys other rows have with nulls
            check_schema(entry, f"{where}, field 'tools': tools[{i}]")
            schemas.append(entry)
    return schemas


def drop_nulls(value: Any) -> Any:
    """`value` without the null-valued keys of its dicts, at every depth (what arrow adds when rows' dicts
    have different keys; a JSON schema never holds a null)."""
    if isinstance(value, dict):
        return {key: drop_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [drop_nulls(item) for item in value]
    return value


def schema_difference(schema: dict, other: dict) -> str:
    """How two tool schemas differ, in words: the keys of their `function` that one has and the other lacks,
    and those whose values differ."""
    mine, theirs = schema.get("function", {}), other.get("function", {})
    parts = []
    if set(mine) - set(theirs):
        parts.append(f"only the row's has {', '.join(repr(k) for k in sorted(set(mine) - set(theirs)))}")
    if set(theirs) - set(mine):
        parts.append(f"only TOOLS' has {', '.join(repr(k) for k in sorted(set(theirs) - set(mine)))}")
    changed = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
    if changed:
        parts.append(f"they differ in {', '.join(repr(k) for k in changed)}")
    return "; ".join(parts) or "they differ outside 'function'"


def warn_row_tools_render_differently(rows_tools: list[list[dict] | None], tools: dict[str, Tool], tokenizer,
                                      source: str) -> None:
    """Warn (one warning for `source`'s rows) where a row's `tools` column gives a tool of the env file's
    `TOOLS` a schema that the chat template renders otherwise than `TOOLS`' own (e.g. an OpenAI-style schema
    without the `"return"` entry transformers' `get_json_schema` adds): such rows' prompts are not the ones
    rendered from `TOOLS`, nor, for SFT rows written without it, the other way round."""
    from rl2.chat.template import render_chat
    from rl2.distributed.process_group import is_rank0

    if not is_rank0():  # every rank reads the same rows: rank 0 says it
        return

    def rendered(schema: dict) -> str:
        return render_chat([{"role": "user", "content": "hi"}], tokenizer, add_generation_prompt=True, tools=[schema])

    differing: dict[str, tuple[int, str]] = {}  # tool name -> (first row, how the schemas differ)
    for i, schemas in enumerate(rows_tools):
        for schema in schemas or ():
            name = schema["function"]["name"]
            if name in differing or name not in tools or schema == tools[name].schema:
                continue
            if rendered(schema) != rendered(tools[name].schema):
                differing[name] = (i + 1, schema_difference(schema, tools[name].schema))
    if differing:
        logger.warning(
            f"{source}: the `tools` of some rows render otherwise than the env file's TOOLS, so those prompts differ "
            "from the ones TOOLS give (and an SFT warm-up on rows like them did not see TOOLS' prompt): "
            + "; ".join(f"{name} (row {row}: {how})" for name, (row, how) in differing.items())
            + ". Give the rows TOOLS' schemas (transformers.utils.get_json_schema(function), or the tool's name "
            "in the row's `tools`), or give TOOLS the rows' schemas as (schema, function) pairs")
