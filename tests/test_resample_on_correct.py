"""GRPO-RoC (rStar2-Agent): `resample_on_correct` down-sampling and the `roc_penalty` of a trajectory,
on tool messages produced by envs/python_tool.py itself."""

import itertools
import json
import math
import os
from collections import Counter

import pytest
import torch

from rl2.algorithms.resample_on_correct import ROC_EPS, resample_on_correct
from rl2.chat.tool_parsers import get_tool_parser
from rl2.chat.tools import Tool, argument_problem
from rl2.tools.roc_penalty import roc_penalty, roc_tool_error
from rl2.rollout.env_file import load_env_file

ENV_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "envs", "python_tool.py")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- how many of each side


# 8 rollouts: positives at 0, 2, 3, 5, 7 (5), negatives at 1, 4, 6 (3).
REWARDS = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
PENALTIES = [0.9, 0.0, 0.1, 0.5, 0.0, 0.1, 0.0, 0.0]
NEGATIVES = {1, 4, 6}


def split(kept: list[int]) -> tuple[list[int], list[int]]:
    return [i for i in kept if REWARDS[i] > 0], [i for i in kept if REWARDS[i] <= 0]


def test_topk_min_each_moves_share_to_the_small_side():
    # k_pos = floor(5 * 4 / 8 + 1/2) = 3, k_neg = 1 < min_each = 2: 2 positives, 2 negatives.
    # Lowest penalties among positives: 7 (0.0), then 2 and 5 tie at 0.1 and the lower index wins.
    for seed in range(5):
        kept = resample_on_correct(REWARDS, PENALTIES, 4, mode="topk", min_each=2, generator=gen(seed))
        positives, negatives = split(kept)
        assert kept == sorted(kept)
        assert positives == [2, 7]
        assert len(negatives) == 2 and set(negatives) <= NEGATIVES


def test_rounding_is_half_up_not_half_to_even():
    # 5 * 4 / 8 = 2.5: half up gives 3 positives (Python's round would give 2).
    kept = resample_on_correct(REWARDS, PENALTIES, 4, mode="topk", min_each=1, generator=gen(0))
    positives, negatives = split(kept)
    assert positives == [2, 5, 7] and len(negatives) == 1
    # 1 * 4 / 8 = 0.5 -> 1: the lone positive stays even without a minimum (round would drop it).
    rewards = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    kept = resample_on_correct(rewards, [0.0] * 8, 4, mode="topk", min_each=0, generator=gen(0))
    assert 3 in kept and len(kept) == 4


def test_proportion_kept_without_minimum():
    # 6 positives of 12, keep 6 -> 3 + 3; 9 of 12, keep 4 -> 3 + 1 (min_each 0 allows a single negative).
    rewards = [1.0, 0.0] * 6
    kept = resample_on_correct(rewards, list(range(12)), 6, mode="topk", min_each=0, generator=gen(0))
    assert [i for i in kept if rewards[i] > 0] == [0, 2, 4]
    assert len([i for i in kept if rewards[i] <= 0]) == 3
    rewards = [1.0] * 9 + [0.0] * 3
    penalties = [0.3, 0.2, 0.1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    kept = resample_on_correct(rewards, penalties, 4, mode="topk", min_each=0, generator=gen(0))
    assert kept[:3] == [0, 1, 2] and len(kept) == 4 and kept[3] in (9, 10, 11)
    # ... but min_each=2 takes one positive (the worst kept, 0) back for a second negative.
    kept = resample_on_correct(rewards, penalties, 4, mode="topk", min_each=2, generator=gen(0))
    assert kept[:2] == [1, 2] and len(kept) == 4 and set(kept[2:]) <= {9, 10, 11}


def test_side_with_fewer_than_min_each_keeps_all_of_it():
    # One positive of 8, keep 4, min_each 2: the positive and 3 negatives.
    rewards = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    for mode in ("topk", "sample"):
        kept = resample_on_correct(rewards, [1.0] * 8, 4, mode=mode, min_each=2, generator=gen(1))
        assert 5 in kept and len(kept) == 4
    # One positive of 16, keep 4: floor(0.25 + 1/2) = 0, but the lone positive is kept.
    rewards = [0.0] * 16
    rewards[9] = 1.0
    for mode in ("topk", "sample"):
        kept = resample_on_correct(rewards, [0.0] * 16, 4, mode=mode, generator=gen(2))
        assert 9 in kept and len(kept) == 4
    # Two positives of 10, keep 4: floor(0.8 + 1/2) = 1, raised to min_each = 2.
    rewards = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    kept = resample_on_correct(rewards, [0.5] * 10, 4, mode="topk", generator=gen(0))
    assert {2, 8} <= set(kept) and len(kept) == 4
    # One negative of 8, keep 4: it stays, with 3 positives (the lowest penalties in topk).
    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    penalties = [0.5, 0.4, 0.3, 2.0, 0.2, 0.6, 0.7, 0.1]
    assert resample_on_correct(rewards, penalties, 4, mode="topk", generator=gen(0)) == [2, 3, 4, 7]


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("mode", ["topk", "sample"])
def test_groups_without_signal_are_dropped(mode):
    for rewards in ([1.0] * 6, [0.0] * 6, [0.5] * 6, [-1.0] * 6):
        assert resample_on_correct(rewards, [0.1] * 6, 3, mode=mode, min_each=1, generator=gen(0)) == []
    # Dropped even when everything would otherwise be kept.
    assert resample_on_correct([1.0] * 4, [0.0] * 4, 8, mode=mode) == []
    assert resample_on_correct([], [], 4, mode=mode) == []


@pytest.mark.parametrize("mode", ["topk", "sample"])
def test_keep_at_or_above_group_size_keeps_everything(mode):
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0]
    for keep in (5, 6, 100):
        assert resample_on_correct(rewards, [0.3] * 5, keep, mode=mode, min_each=2) == [0, 1, 2, 3, 4]


def test_all_positive_with_different_rewards():
    # Nothing is negative: all of `keep` goes to the positives, chosen by penalty.
    rewards = [1.0, 0.5, 1.0, 0.5, 1.0, 0.5]
    penalties = [0.4, 0.0, 0.3, 0.2, 0.1, 0.5]
    assert resample_on_correct(rewards, penalties, 3, mode="topk", min_each=1, generator=gen(0)) == [1, 3, 4]
    kept = resample_on_correct(rewards, penalties, 3, mode="sample", min_each=1, generator=gen(0))
    assert len(kept) == 3 and 1 in kept  # zero penalty: drawn first almost surely


def test_all_negative_with_different_rewards_is_uniform():
    rewards = [0.0, -1.0, 0.0, -0.5, 0.0, -1.0]
    counts = Counter()
    for seed in range(600):
        kept = resample_on_correct(rewards, [0.0, 9.0, 0.0, 9.0, 0.0, 9.0], 2, mode="topk", min_each=1,
                                   generator=gen(seed))
        assert len(kept) == 2
        counts.update(kept)
    # Penalties do not steer negatives: each is kept about 600 * 2 / 6 = 200 times.
    assert all(150 < counts[i] < 250 for i in range(6)), counts


@pytest.mark.parametrize("mode", ["topk", "sample"])
def test_min_each_zero(mode):
    # 7 positives of 8, keep 4, min_each 0: floor(3.5 + 1/2) = 4 positives, the negative dropped.
    rewards = [1.0] * 7 + [0.0]
    penalties = [0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 0.0]
    kept = resample_on_correct(rewards, penalties, 4, mode=mode, min_each=0, generator=gen(3))
    if mode == "topk":
        assert kept == [0, 1, 2, 3]
    else:
        assert len(kept) == 4 and 7 not in kept
    # With the default min_each the negative is kept.
    assert 7 in resample_on_correct(rewards, penalties, 4, mode=mode, generator=gen(3))


@pytest.mark.parametrize("mode", ["topk", "sample"])
def test_same_seed_same_selection(mode):
    rewards = [float(i % 3 == 0) for i in range(16)]
    penalties = [0.1 * (i % 5) + 0.05 for i in range(16)]
    runs = {seed: [resample_on_correct(rewards, penalties, 8, mode=mode, generator=gen(seed)) for _ in range(2)]
            for seed in range(10)}
    assert all(first == second for first, second in runs.values())
    assert len({tuple(first) for first, _ in runs.values()}) > 1  # and different seeds differ


def test_bad_input():
    with pytest.raises(ValueError, match="penalties"):
        resample_on_correct([1.0, 0.0, 1.0], [0.0, 0.0], 2, min_each=1)
    for keep in (0, -3):
        with pytest.raises(ValueError, match="keep"):
            resample_on_correct([1.0, 0.0], [0.0, 0.0], keep)
    with pytest.raises(ValueError, match="mode"):
        resample_on_correct([1.0, 0.0], [0.0, 0.0], 2, mode="random", min_each=1)
    for penalty in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="non-negative"):
            resample_on_correct([1.0, 0.0], [0.0, penalty], 2, min_each=1)
    for min_each in (-1, 3):  # a minimum of 3 per side cannot fit in keep = 4
        with pytest.raises(ValueError, match="min_each"):
            resample_on_correct([1.0, 0.0] * 4, [0.0] * 8, 4, min_each=min_each)


# ---------------------------------------------------------------- the sampling law


def inclusion_law(weights: list[float], k: int) -> dict[frozenset, float]:
    """Exact distribution of the set drawn by k sequential weighted draws without replacement."""
    law: dict[frozenset, float] = Counter()
    for order in itertools.permutations(range(len(weights)), k):
        p, left = 1.0, sum(weights)
        for i in order:
            p *= weights[i] / left
            left -= weights[i]
        law[frozenset(order)] += p
    return law


def test_sample_mode_follows_inverse_penalty_law():
    # Positives at 0, 2, 4, 6, 8; negatives at 1, 3, 5, 7, 9. keep 5: floor(2.5 + 1/2) = 3 positives, 2 negatives.
    rewards = [1.0, 0.0] * 5
    positives, negatives = [0, 2, 4, 6, 8], [1, 3, 5, 7, 9]
    pos_penalties = [0.1, 0.25, 0.5, 1.0, 2.0]
    penalties = [0.0] * 10
    for i, p in zip(positives, pos_penalties):
        penalties[i] = p
    draws, g = 20000, gen(1234)
    subsets, negative_counts = Counter(), Counter()
    for _ in range(draws):
        kept = resample_on_correct(rewards, penalties, 5, mode="sample", generator=g)
        assert len(kept) == 5
        subsets[frozenset(positives.index(i) for i in kept if i in positives)] += 1
        negative_counts.update(i for i in kept if i in negatives)

    law = inclusion_law([1 / (p + ROC_EPS) for p in pos_penalties], 3)
    assert sum(law.values()) == pytest.approx(1.0) and len(law) == 10
    assert set(subsets) <= set(law)
    # Pearson chi-square over the 10 possible sets (9 degrees of freedom; 44.8 is the 1e-6 tail).
    chi2 = sum((subsets[s] - draws * p) ** 2 / (draws * p) for s, p in law.items())
    assert chi2 < 44.8, (chi2, subsets, law)
    # The law is far from uniform: the least penalised positive is kept far more often than the most.
    inclusion = [sum(p for s, p in law.items() if i in s) for i in range(5)]
    assert inclusion[0] > 0.9 and inclusion[4] < 0.2
    # Negatives: each kept with probability 2 / 5, within 5 standard deviations.
    band = 5 * math.sqrt(0.4 * 0.6 / draws)
    for i in negatives:
        assert abs(negative_counts[i] / draws - 0.4) < band, negative_counts


def test_sample_mode_zero_and_equal_penalties():
    rewards = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    # A zero penalty is finite weight 1 / ROC_EPS: kept essentially always, without a division by zero.
    penalties = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    for seed in range(200):
        assert 1 in resample_on_correct(rewards, penalties, 3, mode="sample", min_each=1, generator=gen(seed))
    # Equal penalties (zero included): uniform over the positives.
    for penalty in (0.0, 0.7):
        counts = Counter()
        for seed in range(800):
            counts.update(i for i in resample_on_correct(rewards, [penalty] * 6, 3, mode="sample", min_each=1,
                                                         generator=gen(seed)) if i < 4)
        # floor(4 * 3 / 6 + 1/2) = 2 positives of 4: each kept about 800 / 2 = 400 times.
        assert all(330 < counts[i] < 470 for i in range(4)), counts


# ---------------------------------------------------------------- roc_penalty on our env's messages


@pytest.fixture(scope="module")
def env():
    return load_env_file(ENV_PATH)


def call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


def tool(content: str) -> dict:
    return {"role": "tool", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


PROMPT = [{"role": "system", "content": "You solve math problems."}, {"role": "user", "content": "What is 6 * 7?"}]
TRACEBACK = ('Traceback (most recent call last):\n  File "solution.py", line 1, in <module>\n'
             "ZeroDivisionError: division by zero\n")
RECURSION = ("Traceback (most recent call last):\n" + '  File "solution.py", line 2, in f\n    return f(n)\n' * 50
             + "RecursionError: maximum recursion depth exceeded\n")
SYNTAX = '  File "solution.py", line 1\n    x = (\n        ^\nSyntaxError: \'(\' was never closed\n'


def error_replies(env) -> list[str]:
    """Tool messages the env writes when something went wrong, made by the env's own code."""
    fmt = env.format_result
    return [
        fmt("", TRACEBACK, "error", 4.0, 1024),
        fmt("partial output\n", TRACEBACK, "error", 4.0, 1024),
        fmt("x" * 3000 + "\n", RECURSION, "error", 4.0, 1024),  # long output: the head and the end kept
        fmt("", SYNTAX, "error", 4.0, 1024),  # a program that does not compile has no traceback header
        fmt("", 'Traceback (most recent call last):\n  File "solution.py", line 1, in <module>\nMemoryError\n',
            "memory", 4.0, 1024),
        fmt("1\n2\n", "", "timeout", 4.0, 1024),
        fmt("", "sandbox worker died or stopped answering; it has been replaced", "tool_error", 4.0, 1024),
        fmt("", "code service unreachable", "tool_error", 4.0, 1024),
        *env.parse_python_calls('<tool_call>{"name": "python", "arguments": </tool_call>'),
        *env.parse_python_calls('<tool_call>{"name": "bash", "arguments": {"code": "ls"}}</tool_call>'),
        *env.parse_python_calls('<tool_call>{"name": "python", "arguments": {}}</tool_call>'),
        *env.parse_python_calls("<tool_call>print(1)"),
        "Error: at most 8 tool calls are run per turn; 2 were skipped.",
        *native_error_replies(),
    ]


def native_error_replies() -> list[str]:
    """What rl2 answers a native call the model got wrong (the env's TOOLS path), made by rl2's own code."""
    parsed = get_tool_parser("hermes").parse('<tool_call>\n{"name": "python", "arguments": \n</tool_call>'
                                            '<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call>',
                                            [{"type": "function", "function": {"name": "python"}}])
    schema = {"type": "function", "function": {"name": "python", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
    return [f"Error: {call.error}" for call in parsed.calls] + [
        f"Error: {argument_problem(Tool('python', schema, print), {'program': 'x'})}"]


def ok_replies(env) -> list[str]:
    fmt = env.format_result
    return [
        fmt("42\n", "", "ok", 4.0, 1024),
        fmt("", "", "ok", 4.0, 1024),  # "(no output)"
        fmt("relative error: 1e-12\nno errors found\nError bound 0.5\n", "", "ok", 4.0, 1024),
        fmt("y" * 5000, "", "output_limit", 4.0, 1024),
        fmt("ErrorFunction = erf\n", "", "ok", 4.0, 1024),
    ]


def test_error_markers_match_the_env_messages(env):
    assert len(native_error_replies()) == 3
    errors, oks = error_replies(env), ok_replies(env)
    assert "TimeoutError: the program did not finish within 4 seconds." in errors[5]
    assert "Traceback" not in errors[2] and errors[2].endswith("RecursionError: maximum recursion depth exceeded")
    assert errors[6].startswith("Tool error:") and errors[8].startswith("Error:")
    assert [reply for reply in errors if not roc_tool_error(reply)] == []
    assert [reply for reply in oks if roc_tool_error(reply)] == []


def test_penalty_table(env):
    errors, oks = error_replies(env), ok_replies(env)
    answer = assistant("So the product is \\boxed{42}.")
    calling = assistant("Let me compute.\n" + call("print(6 * 7)"))
    cases = [
        # (messages, p_err + p_format)
        ("no tool call", [answer], 0.5 + 0.0),
        ("all tool calls errored", [calling, tool(errors[0]), calling, tool(errors[5]), calling, tool(errors[6]),
                                    answer], 1.0 + 0.0),
        ("half errored", [calling, tool(oks[0]), tool(errors[3]), calling, tool(oks[2]), tool(errors[8]), answer],
         0.5 + 0.0),
        ("one of three errored", [calling, tool(oks[1]), tool(oks[3]), tool(errors[4]), answer], 1 / 3),
        ("missing answer", [calling, tool(oks[0]), assistant("The product is 42.")], 0.0 + 1.0),
        ("answer only in an earlier turn", [assistant("Maybe \\boxed{42}? " + call("print(6*7)")), tool(oks[0]),
                                            assistant("Confirmed.")], 0.0 + 1.0),
        ("unbalanced tag", [assistant("\\boxed{\\frac{1}{2}")], 0.5 + 1.0),
        ("a closed and an unclosed tag", [assistant("\\boxed{3} or \\boxed{4")], 0.5 + 1.0),
        ("bare \\boxed", [assistant("I will put it in \\boxed")], 0.5 + 1.0),
        ("no assistant message", [], 0.5 + 1.0),
        ("two answers over two turns", [assistant("Guess: \\boxed{42}. Check: " + call("print(6*7)")),
                                        tool(oks[0]), answer], 0.0 + (2 - 1) / 2),
        ("two answers in one turn", [assistant("\\boxed{42}, i.e. \\boxed{42}")], 0.5 + 1.0),
        ("three answers over four turns", [assistant("\\boxed{41}? " + call("print(6*7)")), tool(oks[0]),
                                           assistant("\\boxed{42}. " + call("print(42)")), tool(errors[0]),
                                           assistant(call("print(1)")), tool(oks[0]), answer],
         1 / 3 + (3 - 1) / 4),
        ("answers capped at 1", [assistant("\\boxed{1} " + call("print(1)")), tool(oks[0]),
                                 assistant("\\boxed{2} \\boxed{3} \\boxed{4}")], 0.0 + 1.0),
        ("\\fbox and '\\boxed 5' count", [assistant("\\fbox{4} " + call("print(4)")), tool(oks[0]),
                                          assistant("\\boxed 42")], 0.0 + 1 / 2),
        ("nested braces, one box", [assistant("\\boxed{\\frac{\\sqrt{2}}{2}} \\{x\\}")], 0.5 + 0.0),
        ("a box inside a tool call is code", [assistant(call("print('\\\\boxed{42}')")), tool("\\boxed{42}"), answer],
         0.0 + 0.0),
    ]
    for name, messages, expected in cases:
        assert roc_penalty(PROMPT + messages) == pytest.approx(expected), name
