"""Convert GSM8K and MATH problems into single-turn math RL rows for envs/math.py: the user message is
the problem with an instruction to box the final answer, the answer the gold final answer.

Input rows (JSON / JSON lines / CSV / parquet / arrow files or save_to_disk folders, any mix):

    GSM8K:     {"question": str, "answer": "...reasoning...\\n#### 1,234"}   answer: the text after the
               last "####", without thousands commas ("1234")
    MATH:      {"problem": str, "solution": "... \\boxed{...} ...", "level", "type"}   answer: the
               content of the last \\boxed{...} (or \\fbox{...}) in the solution
    MATH-500:  {"problem": str, "answer": str, ...}   answer: `answer` as it is

Output, one JSON line per problem:

    {"messages": [{"role": "user", "content": problem + INSTRUCTION}], "answer": "1234"}

A malformed row (no problem, no "####" or box to take the answer from) stops the conversion with an
error naming the file and row, and no output is written.

    python recipes/math_grpo/prepare_data.py --input gsm8k_train.parquet --output data/math_grpo/train.jsonl
"""

import argparse
import json
import os
import re
import sys
import tempfile

import datasets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # this checkout's rl2, whether or not (or wherever) rl2 is installed

from rl2.data import DataError, load_rows  # noqa: E402

INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
BOX_COMMANDS = ("\\boxed", "\\fbox")


class RowError(ValueError):
    """What is wrong with one input row; the caller adds the file and row number."""


def convert_row(row: dict) -> dict:
    """One GSM8K, MATH or MATH-500 row as a math RL row; RowError if it is malformed."""
    if row.get("question") is not None:
        question = _text(row, "question")
        answer = gsm8k_answer(_text(row, "answer"))
    elif row.get("problem") is not None:
        question = _text(row, "problem")
        if row.get("answer") is not None:
            answer = _text(row, "answer")
        else:
            try:
                answer = last_boxed(_text(row, "solution"))
            except ValueError as e:
                raise RowError(f"{e} in 'solution'") from None
    else:
        raise RowError("no 'question' or 'problem' field")
    return {"messages": [{"role": "user", "content": question + INSTRUCTION}], "answer": answer}


def _text(row: dict, field: str) -> str:
    value = row.get(field)
    if value is None:
        raise RowError(f"no {field!r} field")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # a MATH-500 answer stored as a number
    if not isinstance(value, str):
        raise RowError(f"{field!r} should be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(f"{field!r} is empty")
    return value.strip()


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after the last "####", commas removed."""
    if "####" not in solution:
        raise RowError("no '####' final answer in 'answer'")
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not answer:
        raise RowError("nothing after '####' in 'answer'")
    return answer


def last_boxed(text: str) -> str:
    """The content of the last \\boxed{...} or \\fbox{...} in `text`, braces balanced (escaped \\{ and
    \\} do not count), or the token of a bare `\\boxed 5`. ValueError when there is no box or the
    last one is unbalanced."""
    start, command = max((text.rfind(command), command) for command in BOX_COMMANDS)
    if start == -1:
        raise ValueError("no \\boxed{...} answer")
    rest = text[start + len(command):]
    if rest.startswith(" ") and not rest.lstrip().startswith("{"):
        # MATH writes a few answers as `$\boxed 5$`: the answer runs to the next space or `$`.
        token = re.match(r" +([^\s$]*)", rest).group(1)
        if not token:
            raise ValueError(f"empty {command} answer")
        return token
    rest = rest.lstrip()
    if not rest.startswith("{"):
        raise ValueError(f"no braces after the last {command}")
    depth, i = 0, 0
    while i < len(rest):
        if rest[i] == "\\":
            i += 2  # an escaped character (\{, \}, \\) neither opens nor closes a group
            continue
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                content = rest[1:i].strip()
                if not content:
                    raise ValueError(f"empty {command}{{}} answer")
                return content
        i += 1
    raise ValueError(f"unbalanced braces in the last {command}{{...}}")


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
                        help="GSM8K, MATH or MATH-500 rows; repeat for several files")
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
