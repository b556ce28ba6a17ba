"""Grading of final math answers: extract the answer from a reply, compare it with the gold answer.

`extract_answer(text)` finds the final answer (the last `\\boxed{...}`, else the last
`<answer>...</answer>`, else a trailing "the answer is X"). `MathGrader` compares it with the gold
answer with math-verify in a pool of worker processes, so a pathological expression costs at most
its timeout and never hangs the run; when math-verify cannot decide, plain fallbacks (normalised
strings, numbers, sympy) are tried.
"""

import concurrent.futures
import math
import multiprocessing
import os
import re
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from fractions import Fraction
from typing import Any, Iterable

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
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{" and (j == 0 or text[j - 1] != "\\"):
            depth += 1
        elif text[j] == "}" and text[j - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
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
    worker processes; call it directly only from a main thread (math-verify uses signal.alarm)."""
    pred = extract_answer(response)
    if pred is None or not pred.strip():
        return 0.0, "no answer"
    try:
        equal, rule = compare(pred, str(gold), timeout)
    except Exception:
        return 0.0, "error"
    return float(equal), rule


def _warm_up() -> None:
    import math_verify  # noqa: F401  (so the first graded call does not pay for the import)


# ----------------------------------------------------------------------------------------------
# the process pool


class MathGrader:
    """Grades replies against gold answers in `workers` processes; a call taking longer than
    `timeout` seconds scores 0.0 and its process is killed (the pool is replaced).

    Thread-safe: `grade` may be called from many threads at once. Use as a context manager or call
    `close()`.
    """

    def __init__(self, workers: int = 2, timeout: float = 5.0):
        if workers < 1 or timeout <= 0:
            raise ValueError(f"need workers >= 1 and timeout > 0, got {workers}, {timeout}")
        self.workers = workers
        self.timeout = float(timeout)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        # At most `workers` tasks are submitted at once, so a task starts as soon as it is submitted
        # and its timeout does not count time spent queued behind other calls.
        self._slots = threading.BoundedSemaphore(workers)

    def grade(self, response_text: str, gold: Any) -> float:
        """1.0 if the reply's final answer equals `gold`, else 0.0 (also on timeout or error)."""
        # math-verify's own timeouts (signal.alarm in the worker's main thread) fire first, so most
        # slow inputs are stopped without killing the process.
        inner_timeout = max(1, int(self.timeout) - 1)
        for _ in range(3):  # retried only when another call's timeout killed the pool under us
            with self._slots:
                pool = self._get_pool()
                try:
                    future = pool.submit(grade_one, response_text, gold, inner_timeout)
                except (BrokenProcessPool, RuntimeError):  # pool was just shut down by another thread
                    continue
                try:
                    return future.result(timeout=self.timeout)[0]
                except concurrent.futures.TimeoutError:
                    self._kill(pool)
                    return 0.0
                except BrokenProcessPool:
                    continue
        return 0.0

    def grade_many(self, pairs: Iterable[tuple[str, Any]]) -> list[float]:
        """`grade(response, gold)` for each pair, `workers` at a time, in input order."""
        pairs = list(pairs)
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.workers) as threads:
            return list(threads.map(lambda pair: self.grade(*pair), pairs))

    def close(self) -> None:
        """Stop the worker processes."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            _terminate(pool)

    def __enter__(self) -> "MathGrader":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _get_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn, not fork: forking a process with threads (torch, the env's thread pool) can deadlock.
                pool = concurrent.futures.ProcessPoolExecutor(
                    self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_exit_with_parent,
                    initargs=(os.getpid(),),
                )
                # Start the processes now, so start-up time is not counted in a call's timeout.
                for future in [pool.submit(_warm_up) for _ in range(self.workers)]:
                    future.result()
                self._pool = pool
            return self._pool

    def _kill(self, pool: concurrent.futures.ProcessPoolExecutor) -> None:
        """Replace `pool` (if still current) after a timeout: its stuck process cannot be cancelled."""
        with self._lock:
            if self._pool is not pool:
                return
            self._pool = None
        _terminate(pool)


def _exit_with_parent(parent: int) -> None:
    """In a worker: end when the parent is gone. A trainer that ends with `os._exit` (or is killed)
    cannot shut its pool down, and an idle worker would otherwise wait on its queue forever."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="rl2-grader-parent-watch").start()


def _terminate(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Kill the pool's processes (running tasks included) and shut it down without waiting."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # private, but no public API before 3.14
    for process in processes:
        if process.is_alive():
            process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.join(timeout=1.0)
