"""Math answer grading: extraction, a table of graded cases, timeouts and dead workers (an answer that
could not be graded raises GradingError, never scores 0), any kind of caller, and the envs/math_reward.py env file."""

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl2.rollout.env import Env
from rl2.tools.math_grader import GradingError, MathGrader, extract_answer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 3.0


def box(x: str) -> str:
    return f"Some working here. So the final answer is $\\boxed{{{x}}}$."


# (gold, response, expected reward)
CASES = [
    # plain integers and negatives
    ("12", box("12"), 1.0),
    ("12", box("13"), 0.0),
    ("12", box(" 12 "), 1.0),
    ("-3", box("-3"), 1.0),
    ("-3", box("3"), 0.0),
    ("3", box("-3"), 0.0),
    ("0", box("0"), 1.0),
    (12, box("12"), 1.0),
    (12, box("12.0"), 1.0),
    (0.5, box("\\frac{1}{2}"), 1.0),
    ("1000", box("1,000"), 1.0),
    ("1000", box("1000"), 1.0),
    ("100", box("1000"), 0.0),
    # fractions vs decimals
    ("\\frac{1}{2}", box("0.5"), 1.0),
    ("0.5", box("\\frac{1}{2}"), 1.0),
    ("\\frac{1}{2}", box("\\dfrac{1}{2}"), 1.0),
    ("\\frac{1}{2}", box("\\tfrac{1}{2}"), 1.0),
    ("\\frac{1}{2}", box("1/2"), 1.0),
    ("\\frac{1}{2}", box("\\frac{2}{4}"), 1.0),
    ("\\frac{1}{2}", box("\\frac{1}{3}"), 0.0),
    ("\\frac{1}{3}", box("0.3333333333"), 1.0),
    ("\\frac{1}{3}", box("0.33"), 0.0),
    ("-\\frac{3}{4}", box("-0.75"), 1.0),
    ("-\\frac{3}{4}", box("\\frac{-3}{4}"), 1.0),
    ("-\\frac{3}{4}", box("\\frac{3}{4}"), 0.0),
    ("\\frac{7}{2}", box("3.5"), 1.0),
    ("\\frac{7}{2}", box("3\\frac{1}{2}"), 1.0),
    ("2.50", box("2.5"), 1.0),
    # radicals and equivalent expressions
    ("2\\sqrt{2}", box("\\sqrt{8}"), 1.0),
    ("\\sqrt{8}", box("2\\sqrt{2}"), 1.0),
    ("2\\sqrt{2}", box("2\\sqrt{3}"), 0.0),
    ("39\\sqrt{7}", box("39\\sqrt{7}"), 1.0),
    ("39\\sqrt{7}", box("39"), 0.0),
    ("39\\sqrt{7}", box("\\sqrt{10647}"), 1.0),
    ("\\frac{\\sqrt{2}}{2}", box("\\frac{1}{\\sqrt{2}}"), 1.0),
    ("\\frac{1}{\\sqrt{2}}", box("\\frac{\\sqrt{2}}{2}"), 1.0),
    ("\\frac{\\sqrt{3}}{2}", box("\\frac{\\sqrt{2}}{2}"), 0.0),
    ("\\pi", box("\\pi"), 1.0),
    ("2\\pi", box("2 \\pi"), 1.0),
    ("2\\pi", box("\\pi"), 0.0),
    ("\\frac{\\pi}{3}", box("\\frac{1}{3}\\pi"), 1.0),
    ("e^{2}", box("e^2"), 1.0),
    ("3^{10}", box("59049"), 1.0),
    ("2^{10}", box("1000"), 0.0),
    # polynomials and algebra
    ("x^2 + 35x + 294", box("x^2+35x+294"), 1.0),
    ("x^2 + 35x + 294", box("35x + x^2 + 294"), 1.0),
    ("x^2 + 35x + 294", box("(x+14)(x+21)"), 1.0),
    ("x^2 + 35x + 294", box("294"), 0.0),
    ("x^2 + 35x + 294", box("x^2 + 35x + 295"), 0.0),
    ("2x+1", box("1+2x"), 1.0),
    ("2x+1", box("2x-1"), 0.0),
    ("\\frac{x+1}{2}", box("\\frac{x}{2}+\\frac{1}{2}"), 1.0),
    ("a^2-b^2", box("(a-b)(a+b)"), 1.0),
    ("x=3", box("x=3"), 1.0),
    ("3", box("x=3"), 1.0),
    ("x=3", box("x=4"), 0.0),
    # sets, tuples, intervals
    ("\\{1,2\\}", box("\\{2,1\\}"), 1.0),
    ("\\{1,2\\}", box("\\{1,3\\}"), 0.0),
    ("1, 2, 3", box("1,2,3"), 1.0),
    ("(1, 2)", box("(1,2)"), 1.0),
    ("(1, 2)", box("(2,1)"), 0.0),
    ("(0,1]", box("(0,1]"), 1.0),
    ("(0,1]", box("(0,1)"), 0.0),
    ("(0,1]", box("[0,1]"), 0.0),
    ("[2, \\infty)", box("[2,\\infty)"), 1.0),
    ("(-\\infty, 3)", box("(-\\infty,3)"), 1.0),
    ("(-\\infty, 3)", box("(-\\infty,3]"), 0.0),
    # units, degrees, percentages, text
    ("5", box("5\\text{ cm}"), 1.0),
    ("5", box("5 \\text{cm}"), 1.0),
    ("5", box("6\\text{ cm}"), 0.0),
    ("30", box("30^\\circ"), 1.0),
    ("30", box("30^{\\circ}"), 1.0),
    ("30^\\circ", box("30"), 1.0),
    ("25\\%", box("25\\%"), 1.0),
    ("25", box("25\\%"), 1.0),
    ("25\\%", box("25"), 1.0),
    ("25\\%", box("26\\%"), 0.0),
    ("\\$18.90", box("18.90"), 1.0),
    ("18.90", box("\\$18.90"), 1.0),
    ("\\text{(B)}", box("\\text{(B)}"), 1.0),
    ("\\text{Monday}", box("\\text{Monday}"), 1.0),
    ("\\text{Monday}", box("\\text{Tuesday}"), 0.0),
    # other answer forms
    ("12", "Let me think.\n<answer>12</answer>", 1.0),
    ("12", "<answer>11</answer> no wait <answer>12</answer>", 1.0),
    ("12", "<answer>12</answer> no wait <answer>11</answer>", 0.0),
    ("12", "Adding them up, the answer is 12.", 1.0),
    ("12", "Adding them up, the answer is $12$.", 1.0),
    ("12", "Answer: 12", 1.0),
    ("12", "The answer is 11.\nActually, I recheck: the answer is 12.", 1.0),
    ("12", "The answer is 12.\nActually, I recheck: the answer is 11.", 0.0),
    ("\\frac{1}{2}", "<answer>\\frac{1}{2}</answer>", 1.0),
    # adversarial formatting
    ("12", "First guess \\boxed{11}, but corrected: \\boxed{12}", 1.0),
    ("12", "First guess \\boxed{12}, but corrected: \\boxed{11}", 0.0),
    ("12", "I am sure it is \\boxed{12} and nothing else, as shown above.", 1.0),
    ("12", "It could be 11 or 13, but the computation gives \\boxed{12}.", 1.0),
    ("12", "It is 12, not 11. \\boxed{11}", 0.0),
    ("\\frac{1}{\\sqrt{2}}", "\\boxed{\\frac{1}{\\sqrt{2}}}", 1.0),
    ("\\frac{1}{\\sqrt{2}}", "\\boxed{\\frac{1}{\\sqrt{3}}}", 0.0),
    ("12", "$\\boxed{12}$", 1.0),
    ("12", "$$\\boxed{  12  }$$", 1.0),
    ("12", "\\fbox{12}", 1.0),
    ("12", "\\boxed 12", 1.0),
    ("12", "\\boxed{}", 0.0),
    ("12", "\\boxed{12", 0.0),
    ("12", "I don't know.", 0.0),
    ("12", "", 0.0),
    ("12", "The number 12 appears here but no final answer is given.", 0.0),
    ("12", box("\\left( 12 \\right)"), 1.0),
    ("12", box("1\\!2"), 1.0),
    ("\\boxed{12}", box("12"), 1.0),
    ("$12$", box("12"), 1.0),
    ("12", box("$12$"), 1.0),
    ("12", box("\\textbf{12}"), 1.0),
]


@pytest.fixture(scope="module")
def grader():
    with MathGrader(workers=2, timeout=TIMEOUT) as grader:
        yield grader


def test_case_table(grader):
    assert len(CASES) >= 100
    got = grader.grade_many([(response, gold) for gold, response, _ in CASES])
    wrong = [(gold, response, expected, value) for (gold, response, expected), value in zip(CASES, got) if value != expected]
    assert not wrong, "\n".join(f"gold={g!r} response={r!r}: expected {e}, got {v}" for g, r, e, v in wrong)


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{5}", "5"),
    ("a \\boxed{1} b \\boxed{2} c", "2"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{ 7 }.", "7"),
    ("\\fbox{3} then \\boxed{4}", "4"),
    ("\\boxed{4} then \\fbox{3}", "3"),
    ("\\boxed 42$", "42"),
    ("\\boxed{1} and \\boxed{2", "1"),  # an unbalanced last box: the one before counts
    ("<answer> 9 </answer>", "9"),
    ("<answer>1</answer><answer>2</answer>", "2"),
    ("\\boxed{3} <answer>2</answer>", "3"),  # a box beats a tag
    ("So the answer is 12.", "12"),
    ("The answer is $\\frac{1}{2}$.", "\\frac{1}{2}"),
    ("answer: -4", "-4"),
    ("The answer is 1.\nThe answer is 2.", "2"),
    ("no final answer here", None),
    ("", None),
    ("\\boxed{}", ""),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def exited(pid: int) -> bool:
    """Whether `pid` has exited (absent, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def kill_during_a_grade(grader: MathGrader, response: str, gold: str):
    """Start grading `response` and SIGKILL its worker while the request is in flight (the worker is
    stopped first, so that the call cannot finish before the kill); the call's future and the pid."""
    [worker] = grader._pool.pids()
    os.kill(worker, signal.SIGSTOP)
    threads = ThreadPoolExecutor(max_workers=1)
    call = threads.submit(grader.grade, response, gold)
    threads.shutdown(wait=False)
    assert wait_until(lambda: grader._pool.busy_pids() == [worker])
    os.kill(worker, signal.SIGKILL)
    return call, worker


def test_a_worker_killed_during_a_grade_is_replaced_and_the_answer_graded_again():
    with MathGrader(workers=1, timeout=TIMEOUT) as grader:
        call, killed = kill_during_a_grade(grader, "\\boxed{3}", "3")
        assert call.result(timeout=60) == 1.0
        assert killed not in grader._pool.pids()
        assert grader.faults.counts() == {"grader_restarts": 1, "grader_retries": 1}
        assert grader.grade("\\boxed{3}", "4") == 0.0


def test_a_worker_that_died_idle_is_replaced():
    with MathGrader(workers=1, timeout=TIMEOUT) as grader:
        [dead] = grader._pool.pids()
        os.kill(dead, signal.SIGKILL)
        assert wait_until(lambda: exited(dead))
        assert grader.grade("\\boxed{3}", "3") == 1.0
        assert grader.faults.counts() == {"grader_restarts": 1}


def test_an_answer_that_cannot_be_graded_raises_instead_of_scoring_0():
    with MathGrader(workers=1, timeout=TIMEOUT, retries=0) as grader:
        call, killed = kill_during_a_grade(grader, "\\boxed{3}", "3")
        expected = "math grader: could not grade the answer " + repr("\\boxed{3}") + " against gold '3': "
        with pytest.raises(GradingError, match=re.escape(expected) + rf"grader worker pool: .*worker pid {killed} "
                                               r"died during the call \(killed by signal 9 \(SIGKILL\)\)"):
            call.result(timeout=60)
        assert grader.faults.counts() == {"grader_restarts": 1}
        assert grader.grade("\\boxed{3}", "3") == 1.0


def test_pathological_input_times_out_and_pool_recovers():
    # `1e999999999` makes the comparison build a billion-digit integer in C code, which neither
    # math-verify's signal.alarm nor anything else can interrupt: only killing the process stops it.
    with MathGrader(workers=1, timeout=1.0) as grader:
        assert grader.grade("\\boxed{2}", "2") == 1.0
        [stuck] = grader._pool.pids()
        start = time.monotonic()
        expected = "no grade within 1.0 s for the answer " + repr("\\boxed{1e999999999}")
        with pytest.raises(GradingError, match=re.escape(expected)):
            grader.grade("\\boxed{1e999999999}", "1")
        assert time.monotonic() - start < 1.0 + 5.0
        assert exited(stuck) and stuck not in grader._pool.pids()
        assert grader.faults.counts() == {"grader_timeouts": 1, "grader_restarts": 1}
        assert grader.grade("\\boxed{3}", "3") == 1.0  # a fresh worker
        assert grader.grade("\\boxed{3}", "4") == 0.0


def test_timeout_in_one_call_does_not_fail_concurrent_calls():
    with MathGrader(workers=2, timeout=1.5) as grader, ThreadPoolExecutor(max_workers=2) as threads:
        slow = threads.submit(grader.grade, "\\boxed{1e999999999}", "1")
        fast = [threads.submit(grader.grade, f"\\boxed{{{i}}}", str(i)) for i in range(8)]
        assert [call.result(timeout=60) for call in fast] == [1.0] * 8
        with pytest.raises(GradingError, match="no grade within 1.5 s"):
            slow.result(timeout=60)
        assert grader.faults.counts() == {"grader_timeouts": 1, "grader_restarts": 1}


# The caller's script: it finds rl2 only through sys.path (a copy whose grade_one calls every answer
# right), so a 1.0 for a wrong answer shows that the workers imported the caller's rl2.
CALLER = """
import sys
sys.path.insert(0, COPY)
import rl2
assert rl2.__file__.startswith(COPY), rl2.__file__
from rl2.tools.math_grader import MathGrader
with MathGrader(workers=1) as grader:
    print(grader.grade("\\\\boxed{1}", "2"))
"""


@pytest.mark.parametrize("caller", ["-c", "stdin", "-m"])
def test_the_grader_works_for_any_caller(caller, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(os.path.join(REPO, "rl2"), copy / "rl2", ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "rl2" / "tools" / "math_grader.py", "a") as f:
        f.write("\n\ndef grade_one(response, gold, timeout=5):\n    return 1.0, 'copy'\n")
    script = CALLER.replace("COPY", repr(str(copy)))
    (tmp_path / "grade_caller.py").write_text(script)
    args = {"-c": ["-c", script], "stdin": ["-"], "-m": ["-m", "grade_caller"]}[caller]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    out = subprocess.run([sys.executable, *args], input=script if caller == "stdin" else None, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env=env)
    assert (out.returncode, out.stdout) == (0, "1.0\n"), out.stderr


def load_env_file(path: str):
    spec = importlib.util.spec_from_file_location("math_env_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_env_file_reward_survives_a_kill_and_raises_when_it_cannot_grade():
    env = load_env_file(os.path.join(REPO, "envs", "math_reward.py"))
    env.WORKERS, env.TIMEOUT = 1, 1.0
    reply = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "So \\boxed{3}."}]
    try:
        grader = env._grader.get()
        [dead] = grader._pool.pids()
        os.kill(dead, signal.SIGKILL)
        assert wait_until(lambda: exited(dead))
        assert env.reward_fn(reply, "3") == 1.0
        assert env.reward_fn(reply, 4) == 0.0
        with pytest.raises(GradingError):
            env.reward_fn([{"role": "assistant", "content": "\\boxed{1e999999999}"}], "1")
        assert grader.faults.counts() == {"grader_restarts": 2, "grader_timeouts": 1}
    finally:
        env._grader.close()


def test_grader_workers_end_with_their_parent():
    """A process that exits without closing its MathGrader (os._exit, a kill) leaves no workers."""
    code = (
        "import os\nfrom rl2.tools.math_grader import MathGrader\ng = MathGrader(workers=2)\n"
        "print(g.grade('\\\\boxed{2}', '2'))\n"
        "print(*g._pool.pids(), flush=True)\nos._exit(0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    grade, pids = out.stdout.split("\n", 1)
    assert grade == "1.0", out.stderr
    pids = [int(pid) for pid in pids.split()]
    assert len(pids) == 2
    assert wait_until(lambda: all(map(exited, pids)))


def test_env_file_scores_conversations_concurrently():
    conversations, answers, expected = [], [], []
    for i in range(12):
        reply = f"Thinking... \\boxed{{{i}}}" if i % 3 else f"I think it is \\boxed{{{i + 1}}}"
        conversations.append([{"role": "user", "content": f"What is {i}?"}, {"role": "assistant", "content": reply}])
        answers.append(str(i) if i % 2 else i)  # str or number
        expected.append(1.0 if i % 3 else 0.0)
    conversations.append([{"role": "user", "content": "Half?"}, {"role": "assistant", "content": "\\boxed{\\dfrac{1}{2}}"}])
    answers.append("0.5")
    expected.append(1.0)
    with Env(os.path.join(REPO, "envs", "math_reward.py"), timeout=30.0, need_interact=False) as env:
        # Several batches from several threads at once share the env's one grader.
        with ThreadPoolExecutor(max_workers=3) as threads:
            batches = list(threads.map(lambda _: env.rewards(conversations, answers), range(3)))
    for results in batches:
        assert [r.error for r in results] == [None] * len(results)
        assert [r.value for r in results] == expected
