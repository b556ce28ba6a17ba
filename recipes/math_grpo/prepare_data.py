"""Convert GSM8K and MATH problems into single-turn math RL rows for envs/math_reward.py: the user message is
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

import os
import sys
import re

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # recipes/, for row_files
from row_files import RowError, run_cli  # noqa: E402

INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
BOX_COMMANDS = ("\\boxed", "\\fbox")


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


def main(argv: list[str] | None = None) -> int:
    return run_cli(__doc__, "GSM8K, MATH or MATH-500 rows", convert_row, argv)


if __name__ == "__main__":
    sys.exit(main())
