"""A row's `tools` that give an env tool a schema the chat template renders otherwise than the env file's `TOOLS`
(an OpenAI-style schema without the `"return"` entry transformers' `get_json_schema` adds) get one warning for the
file, naming the tool, the row and the difference; rows that render as `TOOLS` do get none."""

import json
import logging

import pytest

from rl2.chat.tools import tools_from_entries
from rl2.data.conversations import RLDataset, SFTDataset
from rl2.testing.tiny import build_tiny_tokenizer


def lookup(box: str) -> str:
    """Read the code written on a box.

    Args:
        box: the box's colour
    """
    return "3"


TOOLS = tools_from_entries([lookup], "env.py")
OPENAI_STYLE = {"type": "function", "function": {  # as SFT rows are usually written: no "return"
    "name": "lookup", "description": "Read the code written on a box.",
    "parameters": {"type": "object", "properties": {"box": {"type": "string", "description": "the box's colour"}},
                   "required": ["box"]}}}


def write_rows(tmp_path, tools: list, n: int = 3) -> str:
    path = tmp_path / "rows.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"The code of box {i}?"}], "answer": "3", "tools": tools}
            for i in range(n)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "render otherwise" in r.getMessage()]


def test_the_schemas_differ_by_the_return_entry():
    assert "return" in TOOLS["lookup"].schema["function"] and "return" not in OPENAI_STYLE["function"]


@pytest.mark.parametrize("dataset", [RLDataset, SFTDataset])
def test_rows_whose_tool_schema_renders_otherwise_get_one_warning(dataset, tmp_path, caplog):
    rows = write_rows(tmp_path, [OPENAI_STYLE])
    if dataset is SFTDataset:  # a conversation: the answer as the assistant's reply
        lines = [json.loads(line) for line in open(rows)]
        rows = str(tmp_path / "sft.jsonl")
        with open(rows, "w") as f:
            for row in lines:
                f.write(json.dumps({"messages": row["messages"] + [{"role": "assistant", "content": "3"}],
                                    "tools": row["tools"]}) + "\n")
    with caplog.at_level(logging.WARNING, logger="rl2"):
        dataset(rows, build_tiny_tokenizer(template="qwen2.5"), None, tools=TOOLS)
    [warning] = warnings_of(caplog)  # one for the file, not one a row
    assert "lookup (row 1: only TOOLS' has 'return')" in warning and "get_json_schema" in warning


@pytest.mark.parametrize("tools", [["lookup"], [TOOLS["lookup"].schema]], ids=["by-name", "same-schema"])
def test_rows_rendered_as_tools_get_no_warning(tools, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rl2"):
        RLDataset(write_rows(tmp_path, tools), build_tiny_tokenizer(template="qwen2.5"), None, tools=TOOLS)
    assert warnings_of(caplog) == []


def test_a_template_that_renders_no_tools_renders_both_the_same(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rl2"):
        RLDataset(write_rows(tmp_path, [OPENAI_STYLE]), build_tiny_tokenizer(), None, tools=TOOLS)
    assert warnings_of(caplog) == []
