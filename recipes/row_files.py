"""What the recipes' prepare_data.py scripts share: an env file's constants, the conversion of input
files row by row into one JSON lines file (written whole or not at all), and the command line.

A script defines `convert_row(row) -> dict` (raising `RowError` for a malformed row) and calls
`run_cli(__doc__, input_help, convert_row)`.
"""

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from types import ModuleType
from typing import Callable

import datasets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # this checkout's rl2, whether or not (or wherever) rl2 is installed

from rl2.data.rows import DataError, load_rows  # noqa: E402


class RowError(ValueError):
    """What is wrong with one input row; the caller adds the file and row number."""


def load_env(name: str) -> ModuleType:
    """envs/<name>.py as a module, loaded from its path (envs/ is not put on sys.path, where its files
    would shadow any module of the same name)."""
    spec = importlib.util.spec_from_file_location(f"recipe_env_{name}", os.path.join(REPO, "envs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_rows(path: str):
    """The rows of `path` through `rl2.data.load_rows`; a JSON / JSON lines file that arrow cannot
    type (the original HotpotQA files mix strings and numbers in `supporting_facts` and `context`)
    is read with the json module instead."""
    try:
        return load_rows(path)
    except DataError:
        if not (os.path.isfile(path) and path.endswith((".json", ".jsonl"))):
            raise
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()
        ]
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if not all(isinstance(row, dict) for row in rows):
        raise DataError(f"{path}: expected JSON objects (one per row)")
    return rows


def convert_files(
    inputs: list[str],
    output: str,
    convert_row: Callable[[dict], dict],
    limit: int | None = None,
    dedup_key: Callable[[dict], str] | None = None,
) -> str:
    """Convert the rows of `inputs` into the JSON lines file `output` (created with its folder, or
    replaced whole); rows whose `dedup_key` was seen before are dropped. Returns the summary line.
    Raises DataError for an unreadable file or a malformed row, leaving `output` as it was."""
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    # A temporary file renamed at the end: an error or interrupt never leaves a partial output.
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(output)}.", suffix=".tmp")
    seen: set[str] = set()
    per_file, total_read, total_written = [], 0, 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for path in inputs:
                if limit is not None and total_written >= limit:
                    break
                read = written = 0
                for number, row in enumerate(read_rows(path), 1):
                    if limit is not None and total_written >= limit:
                        break
                    read += 1
                    try:
                        converted = convert_row(row)
                    except RowError as e:
                        raise DataError(f"{path} row {number}: {e}") from None
                    if dedup_key is not None:
                        key = dedup_key(converted)
                        if key in seen:
                            continue
                        seen.add(key)
                    out.write(json.dumps(converted, ensure_ascii=False) + "\n")
                    written += 1
                    total_written += 1
                per_file.append(f"{path}: {read} read, {written} written")
                total_read += read
        os.replace(tmp_path, output)
    except BaseException:
        os.unlink(tmp_path)
        raise
    dropped = f", dropped {total_read - total_written} duplicate problems" if dedup_key is not None else ""
    return f"read {total_read} rows, wrote {total_written} to {output}{dropped} ({'; '.join(per_file)})"


def run_cli(
    doc: str,
    input_help: str,
    convert_row: Callable[[dict], dict],
    argv: list[str] | None = None,
    dedup_key: Callable[[dict], str] | None = None,
) -> int:
    """The scripts' command line: --input (repeatable), --output, --limit, and --no-dedup when the
    script deduplicates. A bad file or row is one `error: ...` line on stderr and exit status 2."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--input", action="append", required=True, metavar="FILE",
                        help=f"{input_help}; repeat for several files")
    parser.add_argument("--output", required=True, metavar="OUT.jsonl", help="JSON lines file to write")
    parser.add_argument("--limit", type=int, metavar="N", help="stop after writing N rows")
    if dedup_key is not None:
        parser.add_argument("--no-dedup", action="store_true", help="keep repeated problems")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit should be at least 1")
    # Errors are reported below, in one line; datasets' progress bars and logged errors would be noise.
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    key = None if dedup_key is None or args.no_dedup else dedup_key
    try:
        print(convert_files(args.input, args.output, convert_row, limit=args.limit, dedup_key=key))
    except DataError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    return 0
