"""Convert question-answering data into Search-R1 RL rows: the user message is Search-R1's prompt
(`make_prompt` of envs/search.py) with the question, the answer the list of gold answers that
envs/search.py's exact-match reward accepts.

Input rows (JSON / JSON lines / CSV / parquet / arrow files or save_to_disk folders, any mix):

    FlashRAG / Search-R1 (nq, triviaqa, hotpotqa, ...):  {"id", "question": str, "golden_answers": [str, ...]}
    HotpotQA:   {"_id", "question": str, "answer": str, "supporting_facts", "context", "type", "level"}
    NQ-open:    {"question": str, "answer": [str, ...]}

Output, one JSON line per question:

    {"messages": [{"role": "user", "content": make_prompt(question)}], "answer": ["gold", ...]}

As in Search-R1's nq_search.py the question is stripped and gets a "?" when it does not end with
one. A malformed row stops the conversion with an error naming the file and row, and no output is
written. The original HotpotQA JSON files cannot be read as they are (their `supporting_facts` and
`context` lists mix strings and numbers, which arrow cannot hold): use the parquet of the
`hotpotqa/hotpot_qa` dataset, or keep only `_id`, `question` and `answer` first.

    python recipes/search_r1/prepare_data.py --input nq_train.parquet --output data/search_r1/train.jsonl
"""

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from types import ModuleType

import datasets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # this checkout's rl2, whether or not (or wherever) rl2 is installed

from rl2.data import DataError, load_rows  # noqa: E402


class RowError(ValueError):
    """What is wrong with one input row; the caller adds the file and row number."""


def load_env(name: str) -> ModuleType:
    """envs/<name>.py as a module, loaded from its path (putting envs/ on sys.path would let
    envs/math.py shadow the standard math module)."""
    spec = importlib.util.spec_from_file_location(f"search_r1_env_{name}", os.path.join(REPO, "envs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_prompt = load_env("search").make_prompt


def convert_row(row: dict) -> dict:
    """One FlashRAG, HotpotQA or NQ-open row as a Search-R1 RL row; RowError if it is malformed."""
    question = row.get("question")
    if question is None:
        raise RowError("no 'question' field")
    if not isinstance(question, str):
        raise RowError(f"'question' should be a string, got {type(question).__name__}")
    question = question.strip()
    if not question:
        raise RowError("'question' is empty")
    if not question.endswith("?"):
        question += "?"
    return {"messages": [{"role": "user", "content": make_prompt(question)}], "answer": gold_answers(row)}


def gold_answers(row: dict) -> list[str]:
    """The gold answers of a row, from `golden_answers` (a list) or `answer` (a string or a list)."""
    field = "golden_answers" if row.get("golden_answers") is not None else "answer"
    golds = row.get(field)
    if golds is None:
        raise RowError("no 'golden_answers' or 'answer' field")
    if isinstance(golds, str):
        golds = [golds]
    if not isinstance(golds, list) or not all(isinstance(gold, str) for gold in golds):
        raise RowError(f"{field!r} should be a string or a list of strings")
    golds = [gold.strip() for gold in golds if gold.strip()]
    if not golds:
        raise RowError(f"{field!r} has no non-empty answer")
    return golds


def prepare(inputs: list[str], output: str, limit: int | None = None) -> str:
    """Convert the rows of `inputs` into the JSON lines file `output` (created with its folder, or
    replaced whole); returns the summary line. Raises DataError for an unreadable file or a
    malformed row, leaving `output` as it was."""
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    # A temporary file renamed at the end: an error or interrupt never leaves a partial output.
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(output)}.", suffix=".tmp")
    per_file, total = [], 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for path in inputs:
                if limit is not None and total >= limit:
                    break
                written = 0
                for number, row in enumerate(load_rows(path), 1):
                    if limit is not None and total >= limit:
                        break
                    try:
                        converted = convert_row(row)
                    except RowError as e:
                        raise DataError(f"{path} row {number}: {e}") from None
                    out.write(json.dumps(converted, ensure_ascii=False) + "\n")
                    written += 1
                    total += 1
                per_file.append(f"{path}: {written} read, {written} written")
        os.replace(tmp_path, output)
    except BaseException:
        os.unlink(tmp_path)
        raise
    return f"read {total} rows, wrote {total} to {output} ({'; '.join(per_file)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", action="append", required=True, metavar="FILE",
                        help="FlashRAG, HotpotQA or NQ-open rows; repeat for several files")
    parser.add_argument("--output", required=True, metavar="OUT.jsonl", help="JSON lines file to write")
    parser.add_argument("--limit", type=int, metavar="N", help="stop after writing N rows")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit should be at least 1")
    # Errors are reported below, in one line; datasets' progress bars and logged errors would be noise.
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        print(prepare(args.input, args.output, limit=args.limit))
    except DataError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
