"""Convert math problems into rStar2-Agent RL rows: the Python-tool system prompt of
envs/python_tool.py, then the problem as the user message; the answer is the ground truth as a string.

Input rows (JSON / JSON lines / CSV / parquet / arrow files or save_to_disk folders, any mix):

    DAPO-Math-17k (BytedTsinghua-SIA/DAPO-Math-17k):
        {"data_source": "math_dapo", "prompt": [{"role": "user", "content": PROMPT}], "ability": "MATH",
         "reward_model": {"ground_truth": "34", "style": "rule-lang"}, "extra_info": {"index": "<uuid>"}}
        where PROMPT wraps the problem in DAPO's "Solve the following math problem step by step ..."
        instructions; the wrapper is stripped to get the bare problem.
    Plain problems (AIME-style test sets):
        {"problem" | "question" | "Problem": str, "answer" | "Answer": str or number}

Output, one JSON line per problem:

    {"messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}],
     "answer": "34"}

The DAPO file repeats each problem many times (1.79M rows, about 17k distinct problems), so rows are
deduplicated by problem text (the first one is kept) unless --no-dedup is given. A malformed row
stops the conversion with an error naming the file and row, and no output is written.

    python recipes/rstar2_agent/prepare_data.py --input dapo-math-17k.parquet --output data/rstar2/train.jsonl
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # recipes/, for row_files
from row_files import RowError, load_env, run_cli  # noqa: E402

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'


SYSTEM_PROMPT: str = load_env("python_tool").SYSTEM_PROMPT


def strip_dapo_wrapper(prompt: str) -> str:
    """The bare problem of a DAPO prompt (the text unchanged, but for surrounding spaces, when it has no wrapper)."""
    return prompt.removeprefix(DAPO_PREFIX).removesuffix(DAPO_SUFFIX).strip()


def convert_row(row: dict) -> dict:
    """One DAPO or plain problem row as an rStar2-Agent RL row; RowError if it is malformed."""
    if row.get("prompt") is not None:
        problem = strip_dapo_wrapper(_dapo_user_message(row["prompt"]))
        reward_model = row.get("reward_model")
        ground_truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        answer = answer_text(ground_truth, "reward_model.ground_truth")
    else:
        problem_field = next((f for f in ("problem", "question", "Problem") if row.get(f) is not None), None)
        if problem_field is None:
            raise RowError("no 'prompt', 'problem' or 'question' field")
        problem = row[problem_field]
        if not isinstance(problem, str):
            raise RowError(f"{problem_field!r} should be a string, got {type(problem).__name__}")
        problem = problem.strip()
        answer_field = "Answer" if row.get("answer") is None and row.get("Answer") is not None else "answer"
        answer = answer_text(row.get(answer_field), answer_field)
    if not problem:
        raise RowError("the problem is empty")
    return {
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}],
        "answer": answer,
    }


def _dapo_user_message(prompt) -> str:
    if not isinstance(prompt, list):
        raise RowError(f"'prompt' should be a list of chat messages, got {type(prompt).__name__}")
    contents = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not contents or not isinstance(contents[-1], str):
        raise RowError("'prompt' has no user message with text content")
    return contents[-1]


def answer_text(value, field: str) -> str:
    """A ground-truth answer as a non-empty string (integral floats without ".0": parquet may store 34 as 34.0)."""
    if value is None:
        raise RowError(f"no {field!r}")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise RowError(f"{field!r} should be a string or a number, got {type(value).__name__}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if not text:
        raise RowError(f"{field!r} is empty")
    return text


def problem_text(row: dict) -> str:
    """What makes two rows the same problem."""
    return row["messages"][-1]["content"]


def main(argv: list[str] | None = None) -> int:
    return run_cli(__doc__, "DAPO-Math-17k or plain problem rows", convert_row, argv, dedup_key=problem_text)


if __name__ == "__main__":
    sys.exit(main())
