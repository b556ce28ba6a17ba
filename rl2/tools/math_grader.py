"""Grading of final math answers: extract the answer from a reply, compare it with the gold answer.

`extract_answer(text)` finds the final answer (the last `\\boxed{...}`, else the last
`<answer>...</answer>`, else a trailing "the answer is X"). `MathGrader` compares it with the gold
answer with math-verify in a pool of worker processes, so a pathological expression costs at most
its timeout and never hangs the run; when math-verify cannot decide, plain fallbacks (normalised
strings, numbers, sympy) are tried. A reply is scored 1.0 (equal) or 0.0 (not equal) only when it
was graded; one that could not be (a timeout, workers that keep dying) raises `GradingError`.
"""

import concurrent.futures
import math
import re
import sys
from fractions import Fraction
from typing import Any, Iterable

from rl2.tools.worker_pool import WorkerFailed, WorkerPool, WorkerTimeout, child_python_environment

# ----------------------------------------------------------------------------------------------
# extraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def _last_box(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` with balanced braces (also `\\boxed 5`)."""
    best: tuple[int, str] | None = None
    for command in _BOX_COMMANDS:
        start = text.rfind(command)
        while start != -1:
            content = _box_content(text, start + len(command))
            if content is not None:
                if best is None or start > best[0]:
                    best = (start, content)
                break
            start = text.rfind(command, 0, start)  # unbalanced: try the one before
    return None if best is None else best[1].strip()


def _box_content(text: str, i: int) -> str | None:
    """The braced group (or `\\boxed 5` style bare token) starting at `text[i]`; None if unbalanced."""
    if i < len(text) and text[i] == " ":  # `\boxed 5`
        match = re.match(r" +([^\s$]+)", text[i:])
        return match.group(1) if match else None
    if i >= len(text) or text[i] != "{":
        return None
    end = closing_brace(text, i)
    return None if end is None else text[i + 1:end]


def closing_brace(text: str, i: int) -> int | None:
    """The index of the `}` that closes the `{` at `text[i]` (braces escaped with a backslash do not
    count); None when it is never closed."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{" and (j == 0 or text[j - 1] != "\\"):
            depth += 1
        elif text[j] == "}" and text[j - 1] != "\\":
            depth -= 1
            if depth == 0:
                return j
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in a reply: the last `\\boxed{}` (or `\\fbox{}`), else the last
    `<answer>...</answer>`, else the last line's "answer is X" / "answer: X"; None when absent."""
    boxed = _last_box(text)
    if boxed is not None:
        return boxed
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    for line in reversed(text.strip().splitlines()):
        # Only "answer is" sentences at the end of a line: "the answer is 12." but not a mid-text mention.
        matches = list(re.finditer(r"answer\s*(?:is|:)\s*:?\s*", line, re.IGNORECASE))
        if matches:
            answer = line[matches[-1].end():].strip().rstrip(".").strip().strip("$").strip()
            return answer or None
    return None


# ----------------------------------------------------------------------------------------------
# comparison (runs in a worker process)


def _normalise(s: str) -> str:
    """A canonical string for equality: no spaces, sizing/spacing commands, `$`, units, degrees, %."""
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{\s*(?:[a-zA-Z ]*?)\}\s*$", "", s) if re.search(r"\d", s) else s  # trailing unit
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "^\\circ", "^{\\circ}", "\\%", "%", "$"):
        s = s.replace(token, "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"(\d)\.0+$", r"\1", s)
    return s


def _as_number(s: str) -> Fraction | None:
    """`s` as an exact number when it is a plain number, `a/b` or `\\frac{a}{b}`; else None."""
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s  # 1,000
    match = re.fullmatch(r"(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(r"(-?)\(?(-?[\d.]+)\)?/\(?(-?[\d.]+)\)?", s)
    try:
        if match:
            value = Fraction(match.group(2)) / Fraction(match.group(3))
            return -value if match.group(1) else value
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def _sympy_equal(a: str, b: str) -> bool:
    """`simplify(a - b) == 0`, parsing LaTeX when sympy's LaTeX parser (antlr4) is available, else
    plain expressions with `sympify`; False when either does not parse."""
    import sympy

    def parse(s: str):
        try:
            from sympy.parsing.latex import parse_latex
            return parse_latex(s)
        except ImportError:  # parse_latex needs antlr4; plain expressions still work
            if "\\" in s or "{" in s:
                return None
            return sympy.sympify(s.replace("^", "**"), evaluate=True)

    try:
        x, y = parse(a), parse(b)
        return x is not None and y is not None and sympy.simplify(x - y) == 0
    except Exception:  # sympy raises many kinds of errors on odd input
        return False


def compare(pred: str, gold: str, timeout: int = 5) -> tuple[bool, str]:
    """Whether the answer `pred` equals `gold`, and which rule decided:
    "math_verify", "string", "numeric", "sympy" or "none" (not equal)."""
    import math_verify

    gold = gold.strip()
    boxed_gold = _last_box(gold)
    gold = (boxed_gold if boxed_gold is not None else gold).strip().strip("$").strip()
    pred = pred.strip().strip("$").strip()
    try:
        # Inside $...$: bare LaTeX is misread (`39\sqrt{7}` parses as 39, `x^2 + 35x + 294` as 294).
        gold_parsed = math_verify.parse(f"${gold}$", parsing_timeout=timeout)
        pred_parsed = math_verify.parse(f"${pred}$", parsing_timeout=timeout)
        if gold_parsed and pred_parsed and math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout):
            return True, "math_verify"
    except Exception:  # math-verify can raise on odd input; the fallbacks below still run
        pass
    a, b = _normalise(pred), _normalise(gold)
    if a and a == b:
        return True, "string"
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        equal = x == y or math.isclose(float(x), float(y), rel_tol=1e-9)
        return equal, ("numeric" if equal else "none")
    if a and b and _sympy_equal(a, b):
        return True, "sympy"
    return False, "none"


def grade_one(response: str, gold: Any, timeout: int = 5) -> tuple[float, str]:
    """(1.0 or 0.0, deciding rule) for a reply against the gold answer, in this process. Used by the
    grader's worker processes; call it directly only from a main thread (math-verify uses signal.alarm)."""
    pred = extract_answer(response)
    if pred is None or not pred.strip():
        return 0.0, "no answer"
    try:
        equal, rule = compare(pred, str(gold), timeout)
    except Exception:
        return 0.0, "error"
    return float(equal), rule


# ----------------------------------------------------------------------------------------------
# the worker pool


class GradingError(RuntimeError):
    """A reply could not be graded (its grading timed out, or its worker kept dying). Not a wrong
    answer: the reward is unknown."""


class MathGrader:
    """Grades replies against gold answers in `workers` processes (`rl2.tools.grader_worker`).

    `grade` returns 1.0 or 0.0 only for a reply that was graded; when grading is impossible it
    raises `GradingError`: a reply that takes longer than `timeout` seconds (its process is killed
    and replaced), or whose worker dies `retries + 1` times. A worker that dies is replaced and the
    reply graded again on a fresh one; `faults` counts `grader_restarts`, `grader_retries` and
    `grader_timeouts`.

    Thread-safe: `grade` may be called from many threads at once. The caller may be any Python
    program (a notebook, `python -c`, a script on stdin). Use as a context manager or call `close()`.
    """

    def __init__(self, workers: int = 2, timeout: float = 5.0, retries: int = 2):
        if workers < 1 or timeout <= 0:
            raise ValueError(f"need workers >= 1 and timeout > 0, got {workers}, {timeout}")
        self.workers = workers
        self.timeout = float(timeout)
        command = [sys.executable, "-m", "rl2.tools.grader_worker"]
        self._pool = WorkerPool("grader", [command] * workers, retries=retries, env=child_python_environment())
        self.faults = self._pool.faults

    def grade(self, response_text: str, gold: Any) -> float:
        """1.0 if the reply's final answer equals `gold`, else 0.0; `GradingError` when it could not
        be graded."""
        # math-verify's own timeouts (signal.alarm in the worker) fire first, so most slow inputs are
        # stopped without killing the process.
        request = {"response": response_text, "gold": str(gold), "timeout": max(1, int(self.timeout) - 1)}
        try:
            response = self._pool.call(request, self.timeout)
        except WorkerTimeout as error:
            raise GradingError(f"math grader: no grade within {self.timeout:.1f} s for the answer "
                               f"{_sample(response_text)} against gold {_sample(str(gold))} (its worker "
                               "process was killed and replaced)") from error
        except WorkerFailed as error:
            raise GradingError(f"math grader: could not grade the answer {_sample(response_text)} against gold "
                               f"{_sample(str(gold))}: {error}") from error
        if "error" in response:
            raise GradingError(f"math grader: grading the answer {_sample(response_text)} failed in the worker: "
                               f"{response['error']}")
        return response["score"]

    def grade_many(self, pairs: Iterable[tuple[str, Any]]) -> list[float]:
        """`grade(response, gold)` for each pair, `workers` at a time, in input order; raises the
        first `GradingError`."""
        pairs = list(pairs)
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.workers) as threads:
            return list(threads.map(lambda pair: self.grade(*pair), pairs))

    def close(self) -> None:
        """Stop the worker processes."""
        self._pool.close()

    def __enter__(self) -> "MathGrader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _sample(text: str, limit: int = 80) -> str:
    """`text` quoted, its middle cut when long: enough of a reply to recognise it in a log."""
    if len(text) > limit:
        text = text[:limit // 2] + " ... " + text[-limit // 2:]
    return repr(text)
