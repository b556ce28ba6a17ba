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
written. The original HotpotQA JSON files (whose `supporting_facts` and `context` lists mix strings
and numbers, which arrow cannot type) are read with the json module.

    python recipes/search_r1/prepare_data.py --input nq_train.parquet --output data/search_r1/train.jsonl
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # recipes/, for row_files
from row_files import RowError, load_env, run_cli  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    return run_cli(__doc__, "FlashRAG, HotpotQA or NQ-open rows", convert_row, argv)


if __name__ == "__main__":
    sys.exit(main())
