"""RL rows from reasoning-gym's procedurally generated, verifiable tasks, and their scoring.

    python -m rl2.data.reasoning_gym leg_counting,basic_arithmetic,spell_backward --rows 3000 --seed 0 \\
        --out data/train.jsonl --test-rows 300 --test-out data/test.jsonl
    python -m rl2.data.reasoning_gym --list        # the task names

[reasoning-gym](https://github.com/open-thought/reasoning-gym) (`pip install 'rl2[envs]'`) generates
each task's problems offline and scores answers to them itself, with partial credit. A row is

    {"messages": [{"role": "user", "content": <the question, then how to write the final answer>}],
     "answer": {"task": <task name>, "entry": <reasoning-gym's entry as JSON text>},
     "data_source": <task name>}

`envs/reasoning_gym.py` scores a reply with the task's own `score_answer(extracted answer, entry)`;
`data_source` (verl's column name) gives the per-task test metrics `test/<task>/reward_mean`.

`--rows N` rows in all, the tasks taking turns (row j is task j mod T's, for T tasks). A task's rows
are entries 0, 1, ... of `reasoning_gym.create_dataset(task, seed=task_seed(seed, task, "train"), size=...)`;
its test rows come from its "test" seed, leaving out questions its training rows ask. The same
arguments give the same rows: the command runs with PYTHONHASHSEED=0 (it restarts itself under it),
since a few tasks (word_ladder, knight_swap, ...) draw from sets of strings, whose order follows the
hash seed. Tasks run with reasoning-gym's default settings.

The entry is stored as JSON text, not as nested columns: the tasks' entries differ in shape (a table
of mixed tasks would not load, and arrow would add the other tasks' keys as nulls) and hold tuples
and integer keys that JSON turns into lists and strings, which some scorers compare with (ARC's
grids are tuples of tuples). `encode_value` tags those (`{"__tuple__": [...]}`, `{"__dict__":
[[key, value], ...]}`) and `decode_value` restores them, so the scorer sees the entry as generated.
"""

import argparse
import difflib
import hashlib
import importlib.util
import json
import os
import re
import sys
import tempfile
from typing import Any

EXTRA_HINT = "pip install 'rl2[envs]' (or pip install reasoning-gym)"
# How the reply gives its final answer: what the prompt asks for and what `extract_answer` reads.
ANSWER_FORMATS = {
    "answer": ("Think it through, then give the final answer in this format: <answer>answer here</answer>. "
               "Put only the final answer inside the tags, no explanation."),
    "boxed": "Think it through, then put only the final answer in \\boxed{} at the end of your reply.",
}
# Tasks that take other tasks as settings instead of generating problems of their own.
NOT_TASKS = ("composite",)
_TUPLE, _DICT = "__tuple__", "__dict__"
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ReasoningGymMissing(ImportError):
    """reasoning-gym is not installed."""


def require_reasoning_gym():
    """The `reasoning_gym` package; `ReasoningGymMissing` (one line, naming the extra) when it is not
    installed. A file named `reasoning_gym.py` on the path (the env file itself) is not taken for it."""
    spec = importlib.util.find_spec("reasoning_gym")
    if spec is None or spec.submodule_search_locations is None:
        raise ReasoningGymMissing(f"reasoning-gym is not installed: {EXTRA_HINT}")
    import reasoning_gym

    return reasoning_gym


def task_names() -> list[str]:
    """Every task reasoning-gym can generate, sorted."""
    require_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(name for name in DATASETS if name not in NOT_TASKS)


def check_tasks(tasks: list[str]) -> None:
    """ValueError naming the first unknown task (with the closest names), or a repeated one."""
    known = task_names()
    for i, task in enumerate(tasks):
        if task not in known:
            close = difflib.get_close_matches(task, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"unknown reasoning-gym task {task!r}{hint}; "
                             f"python -m rl2.data.reasoning_gym --list shows the {len(known)} tasks")
        if task in tasks[:i]:
            raise ValueError(f"task {task!r} is named twice")


# ----------------------------------------------------------------------------------------------
# entries as JSON text


def encode_value(value: Any, where: str = "entry") -> Any:
    """`value` as plain JSON values, tuples and dicts with keys other than strings tagged (see the
    module's doc); TypeError naming the place of a value JSON cannot hold."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [encode_value(item, f"{where}[{i}]") for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        tag_like = len(value) == 1 and next(iter(value)) in (_TUPLE, _DICT)  # would decode as a tag
        if all(isinstance(key, str) for key in value) and not tag_like:
            return {key: encode_value(item, f"{where}.{key}") for key, item in value.items()}
        return {_DICT: [[encode_value(key, f"{where} key"), encode_value(item, f"{where}[{key!r}]")]
                        for key, item in value.items()]}
    raise TypeError(f"{where} is a {type(value).__name__}, which a row cannot hold")


def decode_value(value: Any) -> Any:
    """The inverse of `encode_value`."""
    if isinstance(value, list):
        return [decode_value(item) for item in value]
    if isinstance(value, dict):
        if len(value) == 1 and _TUPLE in value:
            return tuple(decode_value(item) for item in value[_TUPLE])
        if len(value) == 1 and _DICT in value:
            return {decode_value(key): decode_value(item) for key, item in value[_DICT]}
        return {key: decode_value(item) for key, item in value.items()}
    return value


def row_answer(task: str, entry: dict) -> dict:
    """A row's `answer` for reasoning-gym's `entry` of `task`."""
    return {"task": task, "entry": json.dumps(encode_value(entry), ensure_ascii=False)}


def read_answer(answer: Any) -> tuple[str, dict]:
    """(task, entry) of a row's answer: `row_answer`'s dict (or its JSON text); an entry given as a
    dict rather than as JSON text is taken as is. ValueError when it is neither."""
    if isinstance(answer, str):
        try:
            answer = json.loads(answer)
        except json.JSONDecodeError:
            pass
    if not (isinstance(answer, dict) and isinstance(answer.get("task"), str) and "entry" in answer):
        raise ValueError(f'expected a reasoning-gym answer {{"task": name, "entry": ...}}, got {answer!r:.200}')
    entry = answer["entry"]
    entry = decode_value(json.loads(entry) if isinstance(entry, str) else entry)
    if not isinstance(entry, dict):
        raise ValueError(f"the entry of a {answer['task']} answer is a {type(entry).__name__}, not a dict")
    return answer["task"], entry


# ----------------------------------------------------------------------------------------------
# rows


def task_seed(seed: int, task: str, split: str) -> int:
    """The reasoning-gym seed of `task`'s `split` ("train" or "test") rows for `--seed seed`: unrelated
    numbers for each task and split (its entry i is drawn from Random(seed + i))."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{task}/{split}".encode()).digest()[:4], "big") >> 1


def prompt(question: str, answer_format: str = "answer") -> str:
    """The user message of a row: the task's question, then how to write the final answer."""
    return f"{question.rstrip()}\n\n{ANSWER_FORMATS[answer_format]}"


def make_row(task: str, entry: dict, answer_format: str = "answer") -> dict:
    """One RL row of reasoning-gym's `entry` of `task`; ValueError when the entry holds a value that JSON
    cannot (naming it)."""
    try:
        answer = row_answer(task, entry)
    except TypeError as e:
        raise ValueError(f"task {task!r}: {e}") from None
    return {"messages": [{"role": "user", "content": prompt(entry["question"], answer_format)}],
            "answer": answer, "data_source": task}


def _counts(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def _interleave(per_task: list[list[dict]]) -> list[dict]:
    """Rows of all tasks, taking turns: the first of each task, then the second of each, ..."""
    return [rows[i] for i in range(max(map(len, per_task), default=0)) for rows in per_task if i < len(rows)]


def make_rows(tasks: list[str], rows: int, seed: int, test_rows: int = 0,
              answer_format: str = "answer") -> tuple[list[dict], list[dict]]:
    """(training rows, test rows) of `tasks`: `rows` and `test_rows` in all, shared evenly, interleaved.
    A task's test questions are none of its training questions; ValueError when it cannot find enough."""
    rg = require_reasoning_gym()
    check_tasks(tasks)
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer format {answer_format!r}: expected one of {sorted(ANSWER_FORMATS)}")
    train, test = [], []
    for task, n, m in zip(tasks, _counts(rows, len(tasks)), _counts(test_rows, len(tasks))):
        entries = rg.create_dataset(task, seed=task_seed(seed, task, "train"), size=max(n, 1))
        train.append([make_row(task, entries[i], answer_format) for i in range(n)])
        if not m:
            continue
        asked = {row["messages"][0]["content"] for row in train[-1]}
        attempts = 10 * m + 100  # small tasks repeat their questions
        entries = rg.create_dataset(task, seed=task_seed(seed, task, "test"), size=attempts)
        chosen = []
        for i in range(attempts):
            row = make_row(task, entries[i], answer_format)
            if row["messages"][0]["content"] not in asked:
                asked.add(row["messages"][0]["content"])
                chosen.append(row)
                if len(chosen) == m:
                    break
        if len(chosen) < m:
            raise ValueError(f"task {task!r}: only {len(chosen)} of {m} test questions found that are not among its "
                             f"{n} training questions (or each other) in {attempts} tries: ask for fewer rows")
        test.append(chosen)
    return _interleave(train), _interleave(test)


def write_rows(path: str, rows: list[dict]) -> None:
    """`rows` as JSON lines, written whole under a temporary name first (never a partial file)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------------------------
# scoring


def extract_answer(text: str, answer_format: str = "answer") -> str | None:
    """The final answer of a reply: the content of its last `<answer>...</answer>` ("answer") or of its
    last `\\boxed{...}` with balanced braces ("boxed"), stripped; None when there is none."""
    if answer_format == "answer":
        tags = _ANSWER_TAG.findall(text)
        return tags[-1].strip() if tags else None
    if answer_format != "boxed":
        raise ValueError(f"answer format {answer_format!r}: expected one of {sorted(ANSWER_FORMATS)}")
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, begin = 0, start + len("\\boxed")
        for i in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[begin + 1:i].strip()
        start = text.rfind("\\boxed{", 0, start)  # never closed: the box before it
    return None


class Scorer:
    """Scores replies to reasoning-gym rows with each task's own `score_answer` (partial credit kept):
    the last assistant message's answer (`extract_answer` in `answer_format`); 0.0 when it has none.
    One scoring instance of each task is made on first use."""

    def __init__(self, answer_format: str = "answer"):
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format={answer_format!r}: expected one of {sorted(ANSWER_FORMATS)}")
        self.answer_format = answer_format
        self.reasoning_gym = require_reasoning_gym()
        self._score_fns: dict[str, Any] = {}

    def score_fn(self, task: str):
        """`score_answer` of `task` (with reasoning-gym's default settings, which generated the rows)."""
        if task not in self._score_fns:
            self._score_fns[task] = self.reasoning_gym.get_score_answer_fn(task)
        return self._score_fns[task]

    def score_text(self, text: str, answer: Any) -> float:
        task, entry = read_answer(answer)
        extracted = extract_answer(text, self.answer_format)
        if extracted is None:
            return 0.0
        return float(self.score_fn(task)(extracted, entry))

    def __call__(self, messages: list[dict], answer: Any) -> float:
        replies = [m for m in messages if m.get("role") == "assistant"]
        return self.score_text(replies[-1].get("content") or "", answer) if replies else 0.0


# ----------------------------------------------------------------------------------------------
# command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl2.data.reasoning_gym",
                                     description="Write RL rows of reasoning-gym tasks (JSON lines).")
    parser.add_argument("tasks", nargs="?", metavar="TASK[,TASK...]", help="reasoning-gym task names, comma-separated")
    parser.add_argument("--rows", type=int, help="training rows in all, shared evenly by the tasks")
    parser.add_argument("--seed", type=int, default=0, help="the same seed gives the same rows (default 0)")
    parser.add_argument("--out", metavar="TRAIN.jsonl", help="the training rows' file")
    parser.add_argument("--test-rows", type=int, default=0, help="test rows in all (default 0: none)")
    parser.add_argument("--test-out", metavar="TEST.jsonl", help="the test rows' file")
    parser.add_argument("--answer-format", choices=sorted(ANSWER_FORMATS), default="answer",
                        help="what the prompt asks the final answer in: <answer></answer> (default) or \\boxed{}; "
                             "give the env file the same (rollout.env_args.answer_format)")
    parser.add_argument("--list", action="store_true", help="print the task names and exit")
    args = parser.parse_args(argv)
    try:
        if args.list:
            print("\n".join(task_names()))
            return 0
        if not args.tasks or args.rows is None or not args.out:
            parser.error("TASK[,TASK...], --rows and --out are needed (or --list)")
        if args.rows < 1 or args.test_rows < 0:
            parser.error("--rows should be at least 1 and --test-rows at least 0")
        if bool(args.test_rows) != bool(args.test_out):
            parser.error("--test-rows and --test-out go together")
        tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
        train, test = make_rows(tasks, args.rows, args.seed, args.test_rows, args.answer_format)
    except (ImportError, ValueError) as e:
        print(f"rl2: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    write_rows(args.out, train)
    written = [f"{len(train)} training rows to {args.out}"]
    if args.test_out:
        write_rows(args.test_out, test)
        written.append(f"{len(test)} test rows to {args.test_out}")
    print(f"wrote {' and '.join(written)} ({', '.join(tasks)}; seed {args.seed})")
    return 0


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":  # the rows of a few tasks follow the hash seed (module doc)
        os.execve(sys.executable, [sys.executable, "-m", "rl2.data.reasoning_gym", *sys.argv[1:]],
                  {**os.environ, "PYTHONHASHSEED": "0"})
    sys.exit(main())
