"""Tool-call parsers: the text of one assistant turn (special tokens kept, end-of-turn token removed) → its text
content and its tool calls, for the formats real models emit, or through a user's `parse_tool_calls` function.

A call that cannot be read is still returned, with `error` set to one line the model can read in the tool
message, so that a malformed call costs the model a turn instead of silently turning into text. The built-in
parsers never raise on any text: JSON that Python cannot read (an integer past its 4,300-digit limit, nesting
deeper than its recursion limit) and arguments that cannot be written back as JSON (nested deeper than
`MAX_DEPTH`, a value JSON has no form for) are such errors too.
"""

import ast
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol


@dataclass
class ParsedCall:
    """One tool call: its name and arguments when they could be read, else `error` says what is wrong."""

    name: str | None  # None when not even the name could be read
    arguments: dict | None  # None when the arguments did not parse into a JSON object
    raw: str  # the call's text as the model wrote it
    error: str | None = None  # None when it parsed; else one line, written for the model to read


@dataclass
class ParsedTurn:
    """An assistant turn: the text outside the calls (stripped, "" if none) and the calls in order."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(Protocol):
    """Parses one family's assistant turns and names the ids rl2 gives their calls."""

    name: str

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedTurn: ...

    def call_id(self, index: int) -> str: ...


_SPACE = re.compile(r"\s*")
_NAME_IN_JSON = re.compile(r'"name"\s*:\s*"([^"\\]+)"')
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)
# What reading JSON (or a Python literal) may raise on text: JSONDecodeError is a ValueError, as is an integer
# past Python's int-string limit; RecursionError for deep nesting.
_UNREADABLE = (ValueError, RecursionError)
MAX_DEPTH = 100  # the deepest nesting of a call's arguments (no real tool takes more)


def _skip_space(text: str, pos: int) -> int:
    """The index of the first non-whitespace character at or after `pos`."""
    return _SPACE.match(text, pos).end()


def _json_error(error: Exception, start: int = 0) -> str:
    """`Expecting value at character 12`, counted from `start`; for what else reading JSON raises, one line
    saying what it is."""
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} at character {error.pos - start}"
    if isinstance(error, RecursionError):
        return "it is nested too deeply"
    return str(error).split("\n")[0][:200] or type(error).__name__


def _unwritable(arguments: dict) -> str | None:
    """Why `arguments` cannot be a call's arguments (nested deeper than MAX_DEPTH, or no JSON form), or None."""
    stack = [(arguments, 1)]
    while stack:  # without recursion: the depth is what is being checked
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"they are nested deeper than {MAX_DEPTH} levels"
        children = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        stack.extend((child, depth + 1) for child in children)
    try:
        json.dumps(arguments)
    except (ValueError, TypeError, RecursionError) as error:
        return f"they have no JSON form ({_json_error(error)})"
    return None


def _called(name: str | None) -> str:
    """How an error names the call."""
    return f'the call to "{name}"' if name else "the tool call"


def _bad_json(text: str, raw: str, reason: str) -> ParsedCall:
    """A JSON call that does not parse, with its "name" when that can still be read."""
    match = _NAME_IN_JSON.search(text)
    name = match.group(1) if match else None
    return ParsedCall(name, None, raw, f"{_called(name)} is not valid JSON: {reason}")


def _functions(tools: list[dict] | None) -> dict[str, dict]:
    """OpenAI-style tool schemas (`{"type": "function", "function": {...}}`) by function name."""
    found = {}
    for tool in tools or []:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            found[function["name"]] = function
    return found


def _checked(name: Any, arguments: Any, raw: str, tools: list[dict] | None) -> ParsedCall:
    """A call from a decoded name and arguments: an object, a JSON string holding one, or missing (no arguments);
    with `tools`, the name must be one of theirs."""
    if not isinstance(name, str) or not name.strip():
        return ParsedCall(None, None, raw, 'the tool call has no "name" (the function to call)')
    name = name.strip()
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except _UNREADABLE as error:
            reason = f'the arguments of the call to "{name}" are not valid JSON: {_json_error(error)}'
            return ParsedCall(name, None, raw, reason)
    arguments = {} if arguments is None else arguments
    if not isinstance(arguments, dict):
        return ParsedCall(name, None, raw, f'the arguments of the call to "{name}" are not a JSON object')
    problem = _unwritable(arguments)
    if problem is not None:
        return ParsedCall(name, None, raw, f'the arguments of the call to "{name}" cannot be used: {problem}')
    known = _functions(tools)
    if tools is not None and name not in known:
        choices = ", ".join(f'"{n}"' for n in known) or "none"
        return ParsedCall(name, arguments, raw, f'there is no tool named "{name}"; the tools are: {choices}')
    return ParsedCall(name, arguments, raw)


def _from_object(value: Any, raw: str, tools: list[dict] | None) -> ParsedCall:
    """A call from a decoded `{"name": ..., "arguments": {...}}` ("parameters" is read as "arguments")."""
    if not isinstance(value, dict):
        return ParsedCall(None, None, raw, 'the tool call is not a JSON object {"name": ..., "arguments": {...}}')
    return _checked(value.get("name"), value.get("arguments", value.get("parameters")), raw, tools)


def _from_json(text: str, raw: str, tools: list[dict] | None) -> ParsedCall:
    """A call from the JSON text of a `{"name": ..., "arguments": {...}}` object."""
    try:
        return _from_object(json.loads(text), raw, tools)
    except _UNREADABLE as error:
        return _bad_json(text, raw, _json_error(error))


def _tool_call_blocks(text: str, read: Callable[..., ParsedCall], tools: list[dict] | None) -> ParsedTurn:
    """The calls in `<tool_call>...</tool_call>` blocks, each read by `read(body, raw, tools)`; an unclosed last
    block is a call with an error; the text outside the blocks is the content."""
    calls, outside, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        outside.append(text[last : match.start()])
        last = match.end()
        if match.group(1) is not None:
            calls.append(read(match.group(1), match.group(0), tools))
        else:  # the generation was cut, or the model forgot the closing tag
            call = read(match.group(2), match.group(0), tools)
            error = f"{_called(call.name)} is not closed with </tool_call>"
            calls.append(replace(call, error=f"{error}; {call.error}" if call.error else error))
    outside.append(text[last:])
    return ParsedTurn("".join(outside).strip(), calls)


class _NumberedIds:
    """OpenAI-style call ids: `call_0`, `call_1`, ..."""

    def call_id(self, index: int) -> str:
        """The id of the index-th call of a trajectory."""
        return f"call_{index}"


class HermesToolParser(_NumberedIds):
    """Qwen2.5, Qwen3, Hermes: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, any number,
    with text before, between or after them."""

    name = "hermes"

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedTurn:
        """The turn's content and calls."""
        return _tool_call_blocks(text, _from_json, tools)


def _or_text(convert: Callable[[str], Any], value: str) -> Any:
    """`convert(value)`, or the text itself when it does not convert."""
    try:
        return convert(value)
    except Exception:  # ast.literal_eval alone raises ValueError, SyntaxError, TypeError, MemoryError, ...
        return value


def _number(value: str) -> int | float:
    """A JSON-schema number: an int when written as one, else a float."""
    number = float(value)
    return int(number) if number.is_integer() and not any(c in value.lower() for c in ".e") else number


def _convert(value: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text converted to its declared type as vLLM's and SGLang's parsers do: `null` is
    None; an undeclared parameter or a value that does not convert stays text, except a boolean, which is
    `value.lower() == "true"`; object, array and undeclared kinds go through json.loads, then ast.literal_eval."""
    if value.lower() == "null":
        return None
    if schema is None:
        return value
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):  # ["integer", "null"]: the first type that is not null
        kind = next((k for k in kind if k != "null"), "string")
    kind = str(kind).strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        return _or_text(int, value)
    if kind.startswith(("num", "float")):
        return _or_text(_number, value)
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except _UNREADABLE:
            pass
    return _or_text(ast.literal_eval, value)


class Qwen3CoderToolParser(_NumberedIds):
    """Qwen3-Coder: `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`,
    one function per `<tool_call>`; values are text, converted by the types the tools' schemas declare."""

    name = "qwen3_coder"

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedTurn:
        """The turn's content and calls; a missing closing tag makes the call an error."""
        return _tool_call_blocks(text, self._function, tools)

    def _function(self, body: str, raw: str, tools: list[dict] | None) -> ParsedCall:
        """The call inside one `<tool_call>`."""
        start = _skip_space(body, 0)
        if not body.startswith("<function=", start) or ">" not in body[start:]:
            return ParsedCall(None, None, raw, "the tool call does not start with <function=NAME>")
        head_end = body.index(">", start)
        name = body[start + len("<function=") : head_end].strip() or None
        inner, closed, after = body[head_end + 1 :].partition("</function>")
        if name is None or not closed:
            return ParsedCall(name, None, raw, f"{_called(name)} is not of the form <function=NAME>...</function>")
        if after.strip() or "<function=" in inner:
            return ParsedCall(name, None, raw, "write one <function=NAME>...</function> per <tool_call>, nothing else")
        parameters = list(_PARAMETER.finditer(inner))
        if len(parameters) != inner.count("<parameter="):
            return ParsedCall(name, None, raw, f'a parameter of the call to "{name}" is not closed with </parameter>')
        schema = _functions(tools).get(name, {}).get("parameters") or {}
        properties = schema.get("properties", schema) if isinstance(schema, dict) else {}
        arguments = {}
        for parameter in parameters:
            value = parameter.group(2)
            value = value[1:] if value.startswith("\n") else value  # one newline each side, as the real parsers do
            value = value[:-1] if value.endswith("\n") else value
            arguments[parameter.group(1).strip()] = _convert(value, properties.get(parameter.group(1).strip()))
        return _checked(name, arguments, raw, tools)


def _json_sequence(text: str, separator: str) -> list[tuple[Any, str]]:
    """The JSON values of `text`, written one after another with `separator` between them, each with its text;
    ValueError says where the text stops being such a sequence."""
    decoder, values, pos = json.JSONDecoder(), [], _skip_space(text, 0)
    while True:
        try:
            value, end = decoder.raw_decode(text, pos)
        except _UNREADABLE as error:
            raise ValueError(_json_error(error)) from None
        values.append((value, text[pos:end]))
        pos = _skip_space(text, end)
        if pos == len(text):
            return values
        if text[pos] != separator:
            raise ValueError(f"unexpected text after the JSON at character {pos}")
        pos = _skip_space(text, pos + 1)


class Llama3JsonToolParser(_NumberedIds):
    """Llama 3.1/3.2/3.3: the whole turn, optionally after `<|python_tag|>`, is `{"name": ..., "parameters": {...}}`
    ("arguments" also accepted), several separated by `; `. Without the tag, text that is not such JSON is
    content; after the tag, it is a call with an error."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedTurn:
        """The turn's content (text before the tag, if any) and calls."""
        before, tagged, body = text.partition(self.TAG)
        if not tagged:
            before, body = "", text
        try:
            values = _json_sequence(body, ";")
        except ValueError as error:
            if not tagged:
                return ParsedTurn(text.strip())
            return ParsedTurn(before.strip(), [_bad_json(body, body, str(error))])
        keys = ({"name", "parameters"}, {"name", "arguments"})
        if not tagged and not all(isinstance(v, dict) and any(k <= v.keys() for k in keys) for v, _ in values):
            return ParsedTurn(text.strip())
        return ParsedTurn(before.strip(), [_from_object(value, raw, tools) for value, raw in values])


class MistralToolParser:
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3/v7 tokenizers) and
    `[TOOL_CALLS]name[ARGS]{...}` (v13+; v11 writes `name[CALL_ID]id[ARGS]{...}`), repeated per call."""

    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def call_id(self, index: int) -> str:
        """Nine alphanumeric characters, as Mistral's templates require: `000000000`, `000000001`, ..."""
        return f"{index:09d}"

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedTurn:
        """The turn's content (the text before the first `[TOOL_CALLS]`, and any left after a call) and calls."""
        head, *segments = text.split(self.TAG)
        calls, outside = [], [head]
        for segment in segments:
            start = _skip_space(segment, 0)
            read = self._array if segment.startswith("[", start) else self._named
            new_calls, rest = read(segment, start, tools)
            calls += new_calls
            outside.append(rest)
        return ParsedTurn("".join(outside).strip(), calls)

    def _array(self, segment: str, start: int, tools: list[dict] | None) -> tuple[list[ParsedCall], str]:
        """The calls of the JSON array after one `[TOOL_CALLS]`, and the text after it."""
        decoder = json.JSONDecoder()
        try:
            values, end = decoder.raw_decode(segment, start)
        except _UNREADABLE as error:
            return [_bad_json(segment, self.TAG + segment, _json_error(error, start))], ""
        calls, pos = [], start + 1
        for value in values:  # walk the array again to give each call its own text
            pos = _skip_space(segment, pos)
            item_end = decoder.raw_decode(segment, pos)[1]
            calls.append(_from_object(value, segment[pos:item_end], tools))
            pos = _skip_space(segment, item_end) + 1  # past the comma
        return calls, segment[end:]

    def _named(self, segment: str, start: int, tools: list[dict] | None) -> tuple[list[ParsedCall], str]:
        """The call `name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]{...}`) after one `[TOOL_CALLS]`, and the text after."""
        head, has_args, after = segment.partition("[ARGS]")
        if not has_args:
            name = re.match(r"[\w.\-]*", segment[start:]).group(0) or None
            reason = f"{_called(name)} has no [ARGS] before its arguments"
            return [ParsedCall(name, None, self.TAG + segment, reason)], ""
        name, pos = head.partition("[CALL_ID]")[0].strip(), _skip_space(after, 0)
        try:
            arguments, end = json.JSONDecoder().raw_decode(after, pos)
        except _UNREADABLE as error:
            reason = f"the arguments of {_called(name)} are not valid JSON: {_json_error(error, pos)}"
            return [ParsedCall(name or None, None, self.TAG + segment, reason)], ""
        return [_checked(name, arguments, self.TAG + head + has_args + after[:end], tools)], after[end:]


class FunctionToolParser(_NumberedIds):
    """A user's `parse_tool_calls(text) -> (content, [{"name": ..., "arguments": {...} or JSON str}, ...])` from an
    env file. A call may also carry "raw" (its text) and "error" (a line for the model; then "name" and
    "arguments" may be None). What the function returns is checked: TypeError or ValueError says what is wrong;
    what the function raises propagates."""

    def __init__(self, function: Callable[[str], Any], name: str = "parse_tool_calls") -> None:
        if not callable(function):
            raise TypeError(f"{name} must be a function (text) -> (content, calls), not a {type(function).__name__}")
        self.function = function
        self.name = name

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedTurn:
        """The user function's content and calls, checked."""
        result = self.function(text)
        if not isinstance(result, (tuple, list)) or len(result) != 2:
            raise TypeError(f"{self.name} must return a pair (content, calls), not {result!r:.200}")
        content, calls = result
        if content is not None and not isinstance(content, str):
            raise TypeError(f"{self.name} returned content of type {type(content).__name__}; it must be a str")
        if not isinstance(calls, (list, tuple)):
            raise TypeError(f"{self.name} returned calls of type {type(calls).__name__}; they must be a list of dicts")
        return ParsedTurn((content or "").strip(), [self._call(i, call) for i, call in enumerate(calls)])

    def _call(self, index: int, call: Any) -> ParsedCall:
        """One returned call, checked."""
        where = f"{self.name} returned call {index}"
        if not isinstance(call, dict):
            raise TypeError(f'{where} as a {type(call).__name__}; a call is a dict {{"name": ..., "arguments": ...}}')
        if set(call) - {"name", "arguments", "raw", "error"}:
            unknown = sorted(set(call) - {"name", "arguments", "raw", "error"})
            raise ValueError(f'{where} with unknown keys {unknown}; the keys are "name", "arguments", "raw", "error"')
        name, arguments = call.get("name"), call.get("arguments", {})
        raw, error = call.get("raw", ""), call.get("error")
        if not isinstance(raw, str) or not isinstance(error, (str, type(None))):
            raise TypeError(f'{where} whose "raw" or "error" is not a str')
        if error is not None:  # a call the user's function could not read: the model is told why
            arguments = arguments if isinstance(arguments, dict) else None
            return ParsedCall(name if isinstance(name, str) else None, arguments, raw, error)
        if not isinstance(name, str) or not name:
            raise ValueError(f'{where} without a "name" (a non-empty str): {call!r:.200}')
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except _UNREADABLE as bad:
                raise ValueError(f'{where} whose "arguments" string is not valid JSON: {_json_error(bad)}') from None
        if not isinstance(arguments, dict):
            kind = type(arguments).__name__
            raise TypeError(f'{where} whose "arguments" is a {kind}, not a dict or a JSON object string')
        return ParsedCall(name, arguments, raw)


TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """A new parser for the named format; ValueError names the choices for an unknown one."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; the choices are: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
