"""Tree search (rl2.search): selection, expansion and back-propagation against hand-computed trees,
code-augmented steps, training data from trees, determinism, and search beating plain sampling on
a task where the policy must explore."""

import json
import math
import os

import pytest
from transformers import AutoTokenizer

from rl2.config import ConfigError, load_config
from rl2.engines import Engine, Generation, SamplingParams
from rl2.rollout.env import Env
from rl2.search.beam import BeamSearch
from rl2.search.best_of_n import BestOfN
from rl2.search.mcts import MCTS
from rl2.config_checks import check_search_config
from rl2.search.run import no_programs
from rl2.search.solver import Problem, Solver, sandbox_runner
from rl2.search.steps import StepFormat, output_block, parse_step, step_output, step_program
from rl2.search.training_data import ppm_pairs, sft_rows
from rl2.search.tree import Node, backpropagate, puct, select_child, set_priors, tree_to_json, uct
from rl2.tools.sandbox import Sandbox
from conftest import run_python
from search_task import TabularPPM, WalkEngine, problem_messages, run_walk

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = os.path.join(HERE, "envs", "boxed_equals.py")
SAMPLE = SamplingParams(temperature=1.0, max_new_tokens=32)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=32)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def env():
    with Env(ENV) as env:
        yield env


class TableEngine(Engine):
    """Replies from a table keyed by the partial solution so far, cycling through each key's list."""

    def __init__(self, tokenizer, table: dict[str, list[str]]):
        self.tokenizer, self.table, self.served, self.calls = tokenizer, table, {}, 0

    def generate(self, prompts, params):
        self.calls += 1
        out = []
        for prompt in prompts:
            solution = self.tokenizer.decode(prompt, skip_special_tokens=False).split("<|im_start|>assistant\n")[-1]
            n = self.served.get(solution, 0)
            self.served[solution] = n + 1
            replies = self.table[solution]
            tokens = self.tokenizer(replies[n % len(replies)], add_special_tokens=False)["input_ids"]
            out.append(Generation(tokens, [-1.0] * len(tokens), "stop"))
        return out

    def update_weights(self, named_tensors, partial=False):
        raise NotImplementedError


# ---- the tree ---------------------------------------------------------------------------------


def hand_tree() -> tuple[Node, Node, Node, Node]:
    root = Node(visits=3, value_sum=0.0)
    a = root.add_child(Node(text="a", visits=2, value_sum=1.0, prior=0.5))
    b = root.add_child(Node(text="b", visits=1, value_sum=-1.0, prior=0.3))
    c = root.add_child(Node(text="c", prior=0.2))
    return root, a, b, c


def test_uct_against_hand_computed_values():
    root, a, b, c = hand_tree()
    assert uct(a, 1.0) == pytest.approx(0.5 + math.sqrt(math.log(3) / 2))  # 1.2412
    assert uct(b, 1.0) == pytest.approx(-1.0 + math.sqrt(math.log(3)))  # 0.0486
    assert uct(c, 1.0) == math.inf  # unvisited, unscored: tried first
    assert select_child(root, 1.0) is c
    c.score = 0.9  # a PPM score counts as one visit
    assert uct(c, 1.0) == pytest.approx(0.9 + math.sqrt(math.log(3)))
    assert select_child(root, 1.0) is c
    c.score = -0.5
    assert select_child(root, 1.0) is a
    c.valid = False  # an invalid step is never selected, and its Q is -1
    assert select_child(root, 100.0) is b and c.q == -1.0
    assert select_child(Node(), 1.0) is None


def test_puct_against_hand_computed_values():
    root, a, b, c = hand_tree()
    assert puct(a, 1.0) == pytest.approx(0.5 + 0.5 * math.sqrt(3) / 3)  # 0.7887
    assert puct(b, 1.0) == pytest.approx(-1.0 + 0.3 * math.sqrt(3) / 2)
    assert puct(c, 1.0) == pytest.approx(0.2 * math.sqrt(3))  # 0.3464
    assert select_child(root, 1.0, "puct") is a
    assert select_child(root, 10.0, "puct") is c  # more exploration: the unvisited step


def test_backpropagation_and_priors():
    root, a, b, c = hand_tree()
    leaf = c.add_child(Node(text="d"))
    backpropagate(leaf, 1.0)
    assert (leaf.visits, leaf.value_sum, c.visits, c.q, root.visits, root.value_sum) == (1, 1.0, 1, 1.0, 4, 1.0)
    assert (a.visits, b.visits) == (2, 1)  # off the path: untouched
    assert leaf.solution() == "cd" and leaf.depth == 2
    steps = [Node(logprob=math.log(0.5)), Node(logprob=math.log(0.3)), Node(logprob=math.log(0.2))]
    set_priors(steps)
    assert [s.prior for s in steps] == pytest.approx([0.5, 0.3, 0.2])


# ---- steps ------------------------------------------------------------------------------------


def test_parse_step_cuts_at_the_first_delimiter_and_finds_the_code():
    fmt = StepFormat()
    step = parse_step("Add.\n```python\nx = 3\nprint(x)\n```<end_of_step>junk<end_of_answer>", "stop", fmt)
    assert step.text == "Add.\n```python\nx = 3\nprint(x)\n```<end_of_step>"
    assert step.code == "x = 3\nprint(x)" and not step.final and step.error is None
    final = parse_step("So \\boxed{3}.<end_of_answer>", "stop", fmt)
    assert final.final and final.code is None
    eos = parse_step("So \\boxed{3}.<|im_end|>", "stop", fmt, eos_texts=("<|im_end|>",))
    assert eos.final and eos.text == "So \\boxed{3}."
    cut = parse_step("a very long step", "length", fmt)
    assert cut.error is not None and not cut.final
    custom = parse_step("x ## y", "stop", StepFormat(step_end="##", answer_end="$$"))
    assert custom.text == "x ##" and not custom.final


def test_step_program_output_is_the_steps_own():
    program = step_program(["x = 6\nprint('earlier')"], "print(x + 1)")
    with Sandbox(workers=1) as box:
        result = box.run(program)
    assert result.ok and step_output(result.stdout) == "7\n"
    assert output_block("7\n", StepFormat()) == "\n```output\n7\n```\n"
    long = output_block("x" * 100, StepFormat(max_output_chars=10))
    assert long.startswith("\n```output\nxxxxx\n...[90 characters cut]...\nxxxxx\n")


# ---- the solver with hand-scripted policies -----------------------------------------------------

MCTS_TABLE = {
    "": ["A<end_of_step>", "B<end_of_step>"],
    "A<end_of_step>": ["\\boxed{1}<end_of_answer>", "\\boxed{2}<end_of_answer>"],
    "B<end_of_step>": ["\\boxed{2}<end_of_answer>"],
}


def test_mcts_rollouts_against_a_hand_computed_trace(tokenizer, env):
    engine = TableEngine(tokenizer, MCTS_TABLE)
    solver = Solver(engine, tokenizer, SAMPLE, env, no_programs, max_depth=4)
    agent = MCTS(Node(), rollouts=3, width=2, c=1.0)
    solver.solve([Problem([{"role": "user", "content": "q"}], "2")], [agent])
    root = agent.root
    a, b = root.children
    # rollout 1: expand root, take A (first unvisited), expand A, take A1 (wrong): -1 up the path
    # rollout 2: B is unvisited (inf) -> expand B, take B1 (right): +1
    # rollout 3: UCT(B) = 1 + sqrt(ln 2) > UCT(A) = -1 + sqrt(ln 2); in B, B2 is unvisited: +1
    assert engine.calls == 3 and solver.generate_calls == 3
    assert (root.visits, root.value_sum) == (3, 1.0)
    assert (a.visits, a.q, b.visits, b.q) == (1, -1.0, 2, 1.0)
    assert [(n.visits, n.correct, n.reward) for n in a.children] == [(1, False, -1.0), (0, True, 1.0)]
    assert [(n.visits, n.correct) for n in b.children] == [(1, True), (1, True)]
    assert agent.answer() is a.children[1]  # reward 1, Q 1, found first
    assert agent.tokens == sum(n.tokens for n in root.walk()) > 0
    json.dumps(tree_to_json(root))


def test_pairs_and_sft_rows_from_a_fixed_tree(tokenizer, env):
    solver = Solver(TableEngine(tokenizer, MCTS_TABLE), tokenizer, SAMPLE, env, no_programs, max_depth=4)
    agent = MCTS(Node(), rollouts=3, width=2, c=1.0)
    messages = [{"role": "user", "content": "q"}]
    solver.solve([Problem(messages, "2")], [agent])
    pairs = ppm_pairs(agent.root, messages)
    # root: A leads to a right answer but has Q -1, B has Q 1: no rejected step; in B every step is
    # right; in A: the right answer is chosen over the wrong one
    assert pairs == [{"messages": messages, "chosen": "A<end_of_step>\\boxed{2}<end_of_answer>",
                      "rejected": "A<end_of_step>\\boxed{1}<end_of_answer>"}]
    rows = sft_rows(agent.root, messages, per_problem=2)
    # mean Q: B->B1 = B->B2 = 1 (the same text, kept once), A->A2 = 0
    assert [row["messages"][-1]["content"] for row in rows] == [
        "B<end_of_step>\\boxed{2}<end_of_answer>", "A<end_of_step>\\boxed{2}<end_of_answer>"]
    assert all(row["messages"][:-1] == messages for row in rows)


def test_failing_code_makes_a_step_invalid_and_outputs_carry_over(tokenizer, env):
    table = {
        "": ["```python\nprint(1 / 0)\n```<end_of_step>", "```python\nx = 6\nprint(x * 7)\n```<end_of_step>"],
        "```python\nx = 6\nprint(x * 7)\n```<end_of_step>\n```output\n42\n```\n":
            ["```python\nprint(x + 1)\n```\nso \\boxed{7}<end_of_answer>"],
    }
    with Sandbox(workers=2) as box:
        solver = Solver(TableEngine(tokenizer, table), tokenizer, SAMPLE, env, sandbox_runner(box), max_depth=4)
        agent = MCTS(Node(), rollouts=3, width=2, c=1.0)
        solver.solve([Problem([{"role": "user", "content": "q"}], "7")], [agent])
    bad, good = agent.root.children
    assert not bad.valid and "ZeroDivisionError" in bad.error and bad.visits == 0  # pruned
    assert good.text.endswith("<end_of_step>\n```output\n42\n```\n")
    assert good.visits == 3  # every rollout went into the only valid step
    for final in good.children:
        assert final.text.endswith("```output\n7\n```\n") and final.correct
    assert ppm_pairs(agent.root, [])[0]["rejected"] == bad.text  # failed code: a negative example


def test_beam_keeps_the_best_scored_and_best_of_n_samples_independently(tokenizer, env):
    class LengthPPM:  # prefers longer partial solutions: the beam keeps "BB..." over "A..."
        def values(self, conversations):
            return [math.tanh(len(c[-1]["content"]) / 100) for c in conversations]

    table = {"": ["A<end_of_step>", "BB<end_of_step>", "CCC<end_of_step>"],
             "A<end_of_step>": ["\\boxed{1}<end_of_answer>"], "BB<end_of_step>": ["\\boxed{2}<end_of_answer>"],
             "CCC<end_of_step>": ["\\boxed{3}<end_of_answer>"]}
    solver = Solver(TableEngine(tokenizer, table), tokenizer, SAMPLE, env, no_programs, ppm=LengthPPM(),
                    terminal_value="ppm", max_depth=4)
    beam = BeamSearch(Node(), beam_size=2, width=3)
    solver.solve([Problem([{"role": "user", "content": "q"}], "2")], [beam])
    assert [c.text for c in beam.root.children] == ["A<end_of_step>", "BB<end_of_step>", "CCC<end_of_step>"]
    assert [len(c.children) for c in beam.root.children] == [0, 3, 3]  # A fell out of the beam
    assert beam.answer().solution() == "CCC<end_of_step>\\boxed{3}<end_of_answer>"  # highest PPM value
    assert beam.answer().correct is False  # checked for the report, unseen by the search
    best_of = BestOfN(Node(), n=3)
    solver.solve([Problem([{"role": "user", "content": "q"}], "2")], [best_of])
    assert [len(c.children) for c in best_of.root.children] == [1, 1, 1]


def test_every_problem_is_batched_into_one_generate_call_per_round(tokenizer, env):
    engine = WalkEngine(tokenizer, seed=1)
    solver = Solver(engine, tokenizer, SAMPLE, env, no_programs, max_depth=4)
    agents = [MCTS(Node(), rollouts=2, width=3, c=2.0) for _ in range(5)]
    solver.solve([Problem(problem_messages(6, 3), "6") for _ in agents], agents)
    # rollout 1 expands root and three steps below it; rollout 2 starts at an unvisited first step
    # (UCT: +inf) and expands it and two more: 7 calls, every problem in each
    assert engine.calls == 7
    assert all(agent.done and agent.root.visits == 2 for agent in agents)


def test_search_is_deterministic_under_a_seed(tokenizer, env):
    def run(seed):
        engine = WalkEngine(tokenizer, seed=seed)
        solver = Solver(engine, tokenizer, SAMPLE, env, no_programs, max_depth=4)
        agents = [MCTS(Node(), rollouts=4, width=3, c=2.0) for _ in range(3)]
        problems = [Problem(problem_messages(t, 3), str(t)) for t in (5, 6, 7)]
        solver.solve(problems, agents)
        return [(tree_to_json(a.root), ppm_pairs(a.root, p.messages), sft_rows(a.root, p.messages))
                for a, p in zip(agents, problems)]

    assert run(3) == run(3)
    assert run(3) != run(4)


# ---- search beats sampling where the policy must explore ----------------------------------------


def test_mcts_beats_greedy_and_a_ppm_trained_on_its_pairs_makes_beam_beat_best_of_n(tokenizer, env):
    targets = [5, 6, 7, 8] * 6
    greedy, _, _, _ = run_walk(tokenizer, env, lambda: BestOfN(Node(), n=1), targets, seed=0, greedy=True)
    mcts, _, agents, problems = run_walk(tokenizer, env, lambda: MCTS(Node(), rollouts=8, width=3, c=2.0),
                                         targets, seed=0)
    assert greedy == 0.0 and mcts >= 0.6, (greedy, mcts)  # greedy always sums to 3

    # round 2: a PPM fitted on round 1's step-level pairs guides beam search; best-of-N picks its
    # answer with the same PPM, and gets at least the tokens the beam used
    pairs = [row for agent, problem in zip(agents, problems) for row in ppm_pairs(agent.root, problem.messages)]
    assert len(pairs) > 20
    ppm = TabularPPM(pairs)
    beam, beam_tokens, _, _ = run_walk(tokenizer, env, lambda: BeamSearch(Node(), beam_size=2, width=2),
                                       targets, seed=1, ppm=ppm, terminal_value="ppm")
    best_of_n, n_tokens, _, _ = run_walk(tokenizer, env, lambda: BestOfN(Node(), n=4), targets, seed=1,
                                         ppm=ppm, terminal_value="ppm")
    assert beam_tokens <= n_tokens
    assert beam > best_of_n + 0.15, (beam, best_of_n)


# ---- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["search.modes=[mcts,dfs]"], "choose from"),
    (["search.width=0"], "search.width must be >= 1"),
    (["search.terminal_value=ppm"], "needs search.ppm_path"),
    (["search.step_end=X", "search.answer_end=X"], "two different"),
    (["search.selection=random"], "choose one of"),
])
def test_bad_search_config_is_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        check_search_config(load_config(args))


def test_the_search_benchmark_runs():
    """bench/search_walk.py (the figures in bench/RESULTS.md) runs and prints a row per evaluation seed."""
    result = run_python(["bench/search_walk.py", "--seeds", "1", "--problems", "8"])
    rows = [line for line in result.stdout.splitlines() if line.strip().startswith("0 |")]
    assert len(rows) == 2 and "0.00" in rows[0].split("|")[1], result.stdout  # greedy solves nothing
