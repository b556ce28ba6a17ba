"""Rows of conversation data for RL, SFT and pair (reward model / DPO) training: loading, validation,
splitting and writing.

Row formats (one JSON object per row, or the same columns in CSV / parquet / arrow / a saved dataset):

    RL:   {"messages": [{"role": ..., "content": ...}, ...], "answer": <any JSON value>}  (answer optional)
    RL:   {"prompt": str, "answer": ...}    (the prompt text is one user message, through the chat template)
    RL, raw prompt (apply_chat_template=False): {"prompt": str, "answer": <any JSON value>}
    SFT:  {"messages": [...]}                                  (at least one assistant message)
    pair: {"messages": [...], "chosen": str, "rejected": str}  (messages are the prompt; a string: one user message)

The "messages" and "prompt" columns are named by `Columns` (`data.messages_key`, `data.prompt_key`). With
the chat template, a row's conversation is its "messages" cell, else (no such column, or null) its "prompt"
cell; a string in either is one user message. RL rows for an env file that makes its own prompts (RL2
HEAD's `generate`: `Columns.prompt_optional`) need neither column. An RL file without an "answer" column
gives every row the answer None (an env that does not read it); where the column exists, every row needs
a value.

Rows are loaded with `datasets` and validated eagerly, so bad data fails before training starts, with
the file, row and field in the message (`rl2.data.conversations` tokenizes them lazily).
"""

import contextlib
import json
import logging
import math
import os
import random
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

import datasets

from rl2.config import Config, DataConfig
from rl2.config.env_interface import rl2_sample_interface
from rl2.distributed.process_group import rank
from rl2.errors import DataError
from rl2.vision.detect import is_vision_model
from rl2.vision.inputs import text_messages

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
_EXPECTED_MESSAGES = 'expected a non-empty list of {"role", "content"} messages'
# The columns each kind needs besides the prompt / conversation column (`Columns`); RL's "answer" is optional.
OTHER_COLUMNS = {"rl": (), "sft": (), "pair": ("chosen", "rejected")}
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass(frozen=True)
class Columns:
    """Where a row's prompt or conversation is (RL2's keys; the config's `data.messages_key`,
    `data.apply_chat_template`, `data.prompt_key`): with the chat template, the `messages_key` column, or
    the `prompt_key` column where a row has no messages (a string in either is one user message); with
    `apply_chat_template=False` (RL only), the raw prompt text of the `prompt_key` column.
    `prompt_optional`: RL rows may have no prompt at all (the env file's own `generate` makes it, RL2 HEAD).
    `image_key`: the column of a row's images, set when the model reads images (`data.image_key`); message
    content may then also be a list of text and image parts (`rl2.vision.inputs`)."""

    messages_key: str = "messages"
    apply_chat_template: bool = True
    prompt_key: str = "prompt"
    prompt_optional: bool = False
    image_key: str | None = None

    @classmethod
    def from_config(cls, data: DataConfig, prompt_optional: bool = False, images: bool = False) -> "Columns":
        """The columns named by a `DataConfig`; with `images`, its `image_key` too."""
        return cls(data.messages_key, data.apply_chat_template, data.prompt_key, prompt_optional,
                   data.image_key if images else None)

    @classmethod
    def for_run(cls, config: Config, kind: str) -> "Columns":
        """The columns of a run's `kind` rows: RL rows need no prompt when `rollout.env_path` is written to RL2
        HEAD's interface (its `generate` reads the row, `sample.sample`, and makes the prompt itself); SFT, RL and
        pair rows for a vision-language actor have images (`image_key`)."""
        env_path = config.rollout.env_path
        makes_prompts = kind == "rl" and env_path is not None and rl2_sample_interface(env_path) is not None
        images = kind in ("sft", "rl", "pair") and is_vision_model(config.actor.model_name)
        return cls.from_config(config.data, prompt_optional=makes_prompts, images=images)

    def prompt_columns(self) -> tuple[str, ...]:
        """The columns a prompt or conversation is read from, the first one with a value."""
        if not self.apply_chat_template or self.prompt_key == self.messages_key:
            return (self.conversation_key(),)
        return self.messages_key, self.prompt_key

    def conversation_key(self) -> str:
        """The column the prompt or conversation is read from first."""
        return self.messages_key if self.apply_chat_template else self.prompt_key

    def key_of(self, row: Mapping[str, Any]) -> str | None:
        """The column `row`'s prompt or conversation is read from; None when it has none."""
        return next((key for key in self.prompt_columns() if row.get(key) is not None), None)

    def describe(self, column: str) -> str:
        """` (the config key naming it)` for a prompt / conversation column, "" for others."""
        if column not in self.prompt_columns():
            return ""
        if not self.apply_chat_template:
            return " (data.prompt_key, used because data.apply_chat_template=false)"
        return " (data.messages_key)" if column == self.messages_key else " (data.prompt_key)"


# ----------------------------------------------------------------------------------------------
# loading


def load_rows(path: str) -> datasets.Dataset:
    """Load rows from `[split@]path`: a file (.json, .jsonl, .csv, .parquet, .arrow), a directory
    written by `save_to_disk`, or a Hugging Face hub dataset name. The split defaults to "train"."""
    split, location = "train", path
    if "@" in path and not os.path.exists(path):
        split, location = path.split("@", 1)
    location = os.path.expanduser(location)

    with _progress_bars_on_rank0_only():
        if os.path.isdir(location):
            rows = _load_saved(location, split)
        elif os.path.isfile(location):
            rows = _load_file(location, split)
        elif _looks_local(location):
            raise DataError(f"{location}: file not found")
        else:
            rows = _load_hub(location, split)

    if len(rows) == 0:
        raise DataError(f"no rows in {location}")
    logger.info("loaded %d rows from %s (split %s)", len(rows), location, split)
    return rows


@contextlib.contextmanager
def _progress_bars_on_rank0_only():
    """datasets draws its progress bars on every rank that reads a file: only rank 0's are shown."""
    if rank() == 0 or not datasets.is_progress_bar_enabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


def _looks_local(location: str) -> bool:
    # Hub names are "name" or "org/name"; anything else that does not exist is a missing local path.
    if os.path.splitext(location)[1].lower() in FILE_BUILDERS or location.startswith((".", "/", "~")):
        return True
    parts = location.split("/")
    return len(parts) > 2 or (len(parts) == 2 and os.path.isdir(parts[0]))


def _load_saved(location: str, split: str) -> datasets.Dataset:
    try:
        saved = datasets.load_from_disk(location)
    except FileNotFoundError as e:
        raise DataError(f"{location}: not a dataset directory written by save_to_disk ({e})") from e
    except IndexError as e:
        # save_to_disk writes an empty dataset as zero shards, which load_from_disk cannot concatenate.
        raise DataError(f"no rows in {location}") from e
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DataError(f"{location}: unknown split {split!r}; available splits: {sorted(saved)}")
        return saved[split]
    if split != "train":
        raise DataError(f"{location}: unknown split {split!r}; it holds a single dataset (split 'train')")
    return saved


def _load_file(location: str, split: str) -> datasets.Dataset:
    suffix = os.path.splitext(location)[1].lower()
    if suffix not in FILE_BUILDERS:
        raise DataError(f"{location}: unsupported file type {suffix!r}; expected one of {sorted(FILE_BUILDERS)}")
    if split != "train":
        raise DataError(f"{location}: unknown split {split!r}; a single file has only split 'train'")
    if _is_blank(location):
        raise DataError(f"no rows in {location}: the file is empty")
    builder = FILE_BUILDERS[suffix]
    # By default the json builder stores mixed-type fields as JSON text and decodes any string that
    # parses as JSON on the way back (the answer "3" comes back as the number 3). Failing on mixed
    # types instead lets us point at the offending row.
    options = {"on_mixed_types": None, "parse_agent_traces": False} if builder == "json" else {}
    try:
        return datasets.load_dataset(builder, data_files=location, split="train", **options)
    except Exception as e:
        if "corresponds to no data" in str(e):
            raise DataError(f"no rows in {location}") from e
        if builder == "json":
            _raise_json_problem(location)
        raise DataError(f"{location}: could not be read as {builder}: {e.__cause__ or e}") from e


def _load_hub(name: str, split: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataError(f"{name}: not a local file and could not be loaded from the Hugging Face hub: {e}") from e


def _is_blank(location: str) -> bool:
    with open(location, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


class _TypeConflict(Exception):
    pass


def _raise_json_problem(location: str) -> None:
    """Re-read a JSON / JSON lines file that `datasets` rejected and raise a DataError naming the
    malformed line or the first row whose field type differs from earlier rows. Returns if neither."""
    with open(location, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{location}, line {e.lineno}: malformed JSON: {e.msg}") from None
    else:
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{location}, line {lineno}: malformed JSON: {e.msg}") from None
    if not rows:
        raise DataError(f"no rows in {location}")

    types: dict[str, Any] = {}
    for row_number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{location}, row {row_number}: expected a JSON object, got {_type_name(row)}")
        for field, value in row.items():
            try:
                types[field] = _merge_types(types.get(field), _json_type(value, field), field)
            except _TypeConflict as e:
                raise DataError(
                    f"{location}, row {row_number}, field {field!r}: {e}; "
                    "a field must hold the same JSON type in every row"
                ) from None


def _json_type(value: Any, path: str) -> Any:
    """The arrow-relevant type of a JSON value: a name, ("list", item type) or ("object", {key: type});
    None for null, which fits any type."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        item_type = None
        for item in value:
            item_type = _merge_types(item_type, _json_type(item, f"{path}[]"), f"{path}[]")
        return ("list", item_type)
    return ("object", {key: _json_type(item, f"{path}.{key}") for key, item in value.items()})


def _merge_types(a: Any, b: Any, path: str) -> Any:
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0] == "list":
        return ("list", _merge_types(a[1], b[1], f"{path}[]"))
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0] == "object":
        merged = dict(a[1])
        for key, item_type in b[1].items():
            merged[key] = _merge_types(merged.get(key), item_type, f"{path}.{key}")
        return ("object", merged)
    if a != b:
        raise _TypeConflict(f"{path} is {_type_label(b)} here but {_type_label(a)} before")
    return a


def _type_label(t: Any) -> str:
    name = t[0] if isinstance(t, tuple) else t
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


# ----------------------------------------------------------------------------------------------
# validation


def validate_rows(rows: datasets.Dataset, kind: str, source: str, columns: Columns = Columns()) -> None:
    """Check every row for `kind` ("rl", "sft" or "pair"), reading the prompt / conversation from
    `columns`; raise DataError naming `source`, the 1-based row number and the field of the first problem."""
    if kind not in OTHER_COLUMNS:
        raise ValueError(f"unknown data kind {kind!r}; expected one of {sorted(OTHER_COLUMNS)}")
    if not columns.apply_chat_template and kind != "rl":
        raise ValueError(f"apply_chat_template=False (a raw prompt column) is for RL data only, not {kind}")
    present = rows.column_names
    needed = list(OTHER_COLUMNS[kind])
    if not any(key in present for key in columns.prompt_columns()) and not (kind == "rl" and columns.prompt_optional):
        needed.insert(0, columns.conversation_key())
    for column in needed:
        if column not in present:
            raise DataError(
                f"{source}: missing column {column!r}{columns.describe(column)} needed for {kind} data; "
                f"columns present: {present}{_column_hint(present, column, columns, kind)}"
            )
    for row_number, row in enumerate(rows, 1):
        _validate_row(row, kind, f"{source}, row {row_number}", columns)


def _column_hint(present: list[str], missing: str, columns: Columns, kind: str) -> str:
    """A pointer to the other ways of reading prompts, for a file without the prompt column."""
    if missing == columns.prompt_key and not columns.apply_chat_template and columns.messages_key in present:
        return (f"; to read the {columns.messages_key!r} column through the chat template, "
                "set data.apply_chat_template=true")
    if missing == columns.messages_key and kind != "sft":
        return (f"; a column of prompt text is also read, as one user message: data.prompt_key=<its name> "
                f"(now {columns.prompt_key!r})")
    return ""


def _validate_row(row: dict, kind: str, where: str, columns: Columns) -> None:
    messages = row_messages(row, columns, where) if columns.apply_chat_template else []
    if not columns.apply_chat_template:  # a raw prompt: RL rows only (validate_rows)
        row_prompt_text(row, columns, where)
    key = columns.key_of(row) or columns.conversation_key()
    if kind == "sft" and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}, field {key!r}: SFT rows need at least one assistant message")
    if columns.image_key is not None and messages:  # images counted against the placeholders (none decoded)
        images = row.get(columns.image_key) or []
        text_messages(messages, images if isinstance(images, (list, tuple)) else [images], where,
                      columns.image_key, key)
    if kind == "rl" and "answer" in row:
        answer = row["answer"]
        if answer is None or (isinstance(answer, float) and math.isnan(answer)):
            raise DataError(f"{where}, field 'answer': missing (null); in a file with an 'answer' column every "
                            "RL row needs one (leave the column out if the env file does not read answers)")
    if kind == "pair":
        for field in ("chosen", "rejected"):
            value = row[field]
            if not isinstance(value, str) or not value.strip():
                got = "an empty string" if isinstance(value, str) else _type_name(value)
                raise DataError(f"{where}, field {field!r}: expected a non-empty string, got {got}")
        if messages[-1]["role"] == "assistant":
            raise DataError(
                f"{where}, field {key!r}: pair rows hold the prompt in {key!r}, which must not end with "
                "an assistant message; the responses go in 'chosen' and 'rejected'"
            )


def _no_prompt(row: Mapping[str, Any], columns: Columns, where: str) -> DataError:
    first, *others = columns.prompt_columns()
    alternative = "".join(f" or {key!r} text{columns.describe(key)}" for key in others if key in row)
    return DataError(f"{where} has no {first!r} column{columns.describe(first)}{alternative}")


def row_messages(row: Mapping[str, Any], columns: Columns, where: str) -> list[dict]:
    """The conversation of a row read through the chat template: its `messages_key` cell, else its
    `prompt_key` cell (a string in either is one user message); [] for a row without either when
    `columns.prompt_optional`, else DataError."""
    key = columns.key_of(row)
    if key is None:
        if columns.prompt_optional:
            return []
        raise _no_prompt(row, columns, where)
    return read_messages(row[key], where, key, content_parts=columns.image_key is not None)


def row_prompt_text(row: Mapping[str, Any], columns: Columns, where: str) -> str | None:
    """The raw prompt text of a row (`apply_chat_template=False`); None for a row without one when
    `columns.prompt_optional`."""
    key = columns.prompt_key
    if row.get(key) is None:
        if columns.prompt_optional:
            return None
        raise _no_prompt(row, columns, where)
    return parse_prompt(row[key], where, key)


def read_messages(value: Any, where: str, key: str = "messages", content_parts: bool = False) -> list[dict]:
    """A prompt or conversation cell as messages: a list of messages (or its JSON text, as CSV / parquet
    cells hold it) through `parse_messages`; other text is one user message (a plain question column, as
    TRL and verl read it). Text that is a JSON object, or looks like messages but is not JSON, is an error."""
    if not isinstance(value, str):
        return parse_messages(value, where, key, content_parts)
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError as e:
        if value.lstrip().startswith("[") and '"role"' in value:
            raise DataError(f"{where}, field {key!r}: {_EXPECTED_MESSAGES}, got a string that is not JSON "
                            f"({e.msg})") from None
        decoded = None
    if isinstance(decoded, (list, dict)):
        return parse_messages(decoded, where, key, content_parts)
    if not value.strip():
        raise DataError(f"{where}, field {key!r}: the prompt text is empty")
    return [{"role": "user", "content": value}]


def parse_prompt(value: Any, where: str, key: str = "prompt") -> str:
    """The raw prompt text of a row (`apply_chat_template=False`); DataError unless a non-empty string."""
    if isinstance(value, str) and value:
        return value
    got = "an empty string" if isinstance(value, str) else _type_name(value)
    hint = ""
    if isinstance(value, list):
        hint = f"; a column of messages is read with data.apply_chat_template=true data.messages_key={key}"
    raise DataError(
        f"{where}, field {key!r}: expected the raw prompt text (a non-empty string, data.apply_chat_template=false), "
        f"got {got}{hint}"
    )


def parse_messages(value: Any, where: str, key: str = "messages", content_parts: bool = False) -> list[dict]:
    """The messages of a row (its `key` column) as a list of dicts, decoding a JSON string (CSV /
    parquet cells) and dropping null keys that arrow adds when messages have different keys;
    DataError if malformed. With `content_parts` (a model that reads images) a message's content may also
    be a list of parts (dicts with a "type"), which `rl2.vision.inputs` checks."""
    expected = _EXPECTED_MESSAGES
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}, field {key!r}: {expected}, got a string that is not JSON ({e.msg})") from None
    if not isinstance(value, list) or not value:
        got = "an empty list" if isinstance(value, list) else _type_name(value)
        raise DataError(f"{where}, field {key!r}: {expected}, got {got}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(f"{where}, field {key!r}: messages[{i}] should be a dict, got {_type_name(message)}")
        message = {name: item for name, item in message.items() if item is not None}
        role = message.get("role")
        if role is None:
            raise DataError(f"{where}, field {key!r}: messages[{i}] has no 'role'")
        if role not in ROLES:
            raise DataError(f"{where}, field {key!r}: messages[{i}] has role {role!r}; expected one of {ROLES}")
        if "tool_calls" in message:
            message["tool_calls"] = _parse_tool_calls(message["tool_calls"], f"{where}, field {key!r}: messages[{i}]")
            message.setdefault("content", "")  # OpenAI's null content beside tool calls
        content = message.get("content")
        if content_parts and isinstance(content, list) and content and all(isinstance(p, dict) for p in content):
            message["content"] = [{name: item for name, item in part.items() if item is not None} for part in content]
        elif not isinstance(content, str):
            raise DataError(
                f"{where}, field {key!r}: messages[{i}] 'content' should be a string, "
                f"got {_type_name(message.get('content'))}"
            )
        messages.append(message)
    return messages


def _parse_tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as chat templates take them: `{"id", "type": "function",
    "function": {"name", "arguments": dict}}`, arguments given as a JSON string decoded, the nulls arrow
    adds dropped; DataError naming the call that is malformed."""
    if not isinstance(value, list):
        raise DataError(f"{where} 'tool_calls' should be a list, got {_type_name(value)}")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(f"{where} tool_calls[{j}] should be "
                            '{"type": "function", "function": {"name": ..., "arguments": {...}}}')
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise DataError(f"{where} tool_calls[{j}] arguments are a string that is not JSON ({e.msg})") from None
        arguments = {} if arguments is None else arguments
        if not isinstance(arguments, dict):
            raise DataError(f"{where} tool_calls[{j}] arguments should be a JSON object, got {_type_name(arguments)}")
        arguments = {name: item for name, item in arguments.items() if item is not None}
        call = {name: item for name, item in call.items() if item is not None}
        calls.append({**call, "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def write_jsonl(path: str, rows: list[dict]) -> None:
    """Rows as JSON lines, written whole under a temporary name first, so an interrupted run leaves
    no partial file (values JSON cannot hold are written as their str)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows)
    os.replace(path + ".tmp", path)


def write_json(path: str, value: dict) -> None:
    """`value` as an indented JSON file, written whole under a temporary name first, as `write_jsonl`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def split_rows(rows: datasets.Dataset, test_ratio: float, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """A deterministic (train, test) split of `rows`, each keeping the original row order. The test
    split has round(len * test_ratio) rows, at least one when test_ratio > 0."""
    if not 0 <= test_ratio < 1:
        raise ValueError(f"test_ratio should be in [0, 1), got {test_ratio}")
    num_test = max(1, round(len(rows) * test_ratio)) if test_ratio > 0 else 0
    if num_test >= len(rows):
        raise DataError(f"test_ratio={test_ratio} leaves no training rows out of {len(rows)}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return rows.select(sorted(order[num_test:])), rows.select(sorted(order[:num_test]))
