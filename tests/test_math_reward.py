"""Math answer grading: extraction, a table of graded cases, timeouts, and the envs/math.py env file."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl2.env import Env
from rl2.tools.math_grader import MathGrader, extract_answer

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


def test_pathological_input_times_out_and_pool_recovers():
    # `1e999999999` makes the comparison build a billion-digit integer in C code, which neither
    # math-verify's signal.alarm nor anything else can interrupt: only killing the process stops it.
    with MathGrader(workers=1, timeout=1.0) as grader:
        assert grader.grade("\\boxed{2}", "2") == 1.0
        start = time.monotonic()
        assert grader.grade("\\boxed{1e999999999}", "1") == 0.0
        assert time.monotonic() - start < 1.0 + 2.0
        assert grader.grade("\\boxed{3}", "3") == 1.0  # a fresh pool
        assert grader.grade("\\boxed{3}", "4") == 0.0


def test_timeout_in_one_call_does_not_fail_concurrent_calls():
    with MathGrader(workers=2, timeout=1.5) as grader:
        pairs = [("\\boxed{1e999999999}", "1")] + [(f"\\boxed{{{i}}}", str(i)) for i in range(8)]
        start = time.monotonic()
        assert grader.grade_many(pairs) == [0.0] + [1.0] * 8
        assert time.monotonic() - start < 1.5 + 5.0


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
    with Env(os.path.join(REPO, "envs", "math.py"), timeout=30.0, need_interact=False) as env:
        # Several batches from several threads at once share the env's one grader.
        with ThreadPoolExecutor(max_workers=3) as threads:
            batches = list(threads.map(lambda _: env.rewards(conversations, answers), range(3)))
    for results in batches:
        assert [r.error for r in results] == [None] * len(results)
        assert [r.value for r in results] == expected
