"""The solver: drives the search agents of many problems together, batching the work of a round.

Each round it gathers the nodes every agent wants expanded, samples all their candidate steps in
one `engine.generate` call, runs every candidate's program in one concurrent sandbox batch, checks
the final answers with the env's `reward_fn` in one batch, scores the new steps with the process
preference model in one batch, and hands each agent its results.
"""

import concurrent.futures
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rl2.chat.template import render_chat
from rl2.config import TERMINAL_VALUES
from rl2.engines import Engine, SamplingParams
from rl2.rollout.env import Env
from rl2.search.agent import SearchAgent
from rl2.search.steps import StepFormat, output_block, parse_step, step_output, step_program
from rl2.search.tree import Node, set_priors
from rl2.tools.sandbox import RunResult, Sandbox

CORRECT, WRONG = 1.0, -1.0


class StepScorer(Protocol):
    """A process preference model: the value in [-1, 1] of each partial solution of a problem."""

    def values(self, conversations: list[list[dict]]) -> list[float]: ...


@dataclass
class Problem:
    """A dataset row to solve: the prompt messages and the reference answer."""

    messages: list[dict]
    answer: Any


def sandbox_runner(sandbox: Sandbox, timeout: float | None = None) -> Callable[[list[str]], list[RunResult]]:
    """Runs a batch of Python programs on `sandbox`'s workers at once, results in order."""

    def run(programs: list[str]) -> list[RunResult]:
        if not programs:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(programs), sandbox.workers)) as pool:
            return list(pool.map(lambda program: sandbox.run(program, timeout=timeout), programs))

    return run


class Solver:
    """Expands the frontier nodes of many search agents per round (see the module docstring).

    `terminal_value` says what a finished solution is worth to the search: "env" (+1 if the env's
    `reward_fn` scores it above 0, else -1; needs the reference answers) or "ppm" (the PPM's score;
    the answer is still checked, for the report and the training data, but the search does not see
    it). `any_rank_pending`, for an engine whose ranks generate in lockstep, says whether any rank
    still has work, so that every rank keeps calling `generate` until all are done.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        params: SamplingParams,
        env: Env,
        run_programs: Callable[[list[str]], list[RunResult]],
        fmt: StepFormat | None = None,
        ppm: StepScorer | None = None,
        terminal_value: str = "env",
        max_depth: int = 16,
        max_length: int | None = None,
        any_rank_pending: Callable[[bool], bool] | None = None,
    ):
        if terminal_value not in TERMINAL_VALUES:
            raise ValueError(f"terminal_value must be one of {TERMINAL_VALUES}, got {terminal_value!r}")
        if terminal_value == "ppm" and ppm is None:
            raise ValueError("terminal_value='ppm' needs a process preference model")
        self.engine, self.tokenizer, self.env, self.ppm = engine, tokenizer, env, ppm
        self.fmt = fmt or StepFormat()
        self.params = dataclasses.replace(params, stop=list(dict.fromkeys([*params.stop, *self.fmt.stops])))
        self.run_programs, self.terminal_value = run_programs, terminal_value
        self.max_depth, self.max_length = max_depth, max_length
        self.any_rank_pending = any_rank_pending
        self.eos_texts = tuple(t for t in (tokenizer.eos_token, tokenizer.pad_token) if t)
        self.generate_calls = 0

    def solve(self, problems: list[Problem], agents: list[SearchAgent]) -> None:
        """Run the agents (one per problem) until every one is done."""
        prefixes = [render_chat(problem.messages, self.tokenizer, add_generation_prompt=True) for problem in problems]
        while True:
            requests = [(i, node, k) for i, agent in enumerate(agents) if not agent.done for node, k in agent.requests()]
            pending = bool(requests)
            if self.any_rank_pending is not None:
                pending = self.any_rank_pending(pending)
            if not pending:
                return
            children = self.expand(requests, problems, prefixes)
            by_agent: dict[int, list[tuple[Node, list[Node]]]] = {}
            for (i, node, _), new in zip(requests, children):
                by_agent.setdefault(i, []).append((node, new))
                agents[i].tokens += sum(child.tokens for child in new)
            for i, results in by_agent.items():
                agents[i].expanded(results)

    def expand(
        self, requests: list[tuple[int, Node, int]], problems: list[Problem], prefixes: list[str]
    ) -> list[list[Node]]:
        """Sample, run and score `k` candidate next steps for each (problem index, node, k)."""
        prompts, owners = [], []
        for r, (i, node, k) in enumerate(requests):
            prompt = self.tokenizer(prefixes[i] + node.solution(), add_special_tokens=False)["input_ids"]
            if self.max_length is not None and len(prompt) + self.params.max_new_tokens > self.max_length:
                continue  # no room for another step: the node gets no children (a dead end)
            prompts += [prompt] * k
            owners += [r] * k
        generations = self.engine.generate(prompts, self.params)
        self.generate_calls += 1
        children: list[list[Node]] = [[] for _ in requests]
        for r, generation in zip(owners, generations):
            node = requests[r][1]
            text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=False)
            step = parse_step(text, generation.finish_reason, self.fmt, self.eos_texts)
            error = generation.error or ("generation aborted" if generation.finish_reason == "abort" else step.error)
            child = node.add_child(Node(text=step.text, code=step.code, terminal=step.final))
            child.tokens = len(generation.token_ids)
            child.logprob = sum(generation.logprobs) / max(len(generation.logprobs), 1)
            if error is not None:
                child.valid, child.error = False, error
            children[r].append(child)
        new = [(child, requests[r][0]) for r, batch in enumerate(children) for child in batch]
        self._run_code([child for child, _ in new if child.valid and child.code is not None])
        self._check_answers([(child, problems[i]) for child, i in new if child.valid])
        self._score([(child, problems[i]) for child, i in new if child.valid])
        for (_, node, _), batch in zip(requests, children):
            set_priors(batch)
            node.expanded = True
        return children

    def _run_code(self, steps: list[Node]) -> None:
        programs = [step_program(step.program_history(), step.code) for step in steps]
        for step, result in zip(steps, self.run_programs(programs)):
            if result.ok:
                step.text += output_block(step_output(result.stdout), self.fmt)
            else:
                step.valid = False
                detail = (result.stderr.strip().splitlines() or [""])[-1]
                step.error = f"code {result.reason}: {detail}"[:300]

    def _check_answers(self, steps: list[tuple[Node, Problem]]) -> None:
        """Final answers are checked against the reference; a step at the depth limit is a wrong end."""
        for child, _ in steps:
            if not child.terminal and child.depth >= self.max_depth:
                child.terminal, child.correct, child.reward = True, False, WRONG
        finals = [(child, problem) for child, problem in steps if child.terminal and child.correct is None]
        if not finals:
            return
        results = self.env.rewards([self._conversation(p, child) for child, p in finals], [p.answer for _, p in finals])
        for (child, _), result in zip(finals, results):
            if result.error is not None:
                child.valid, child.error = False, f"reward_fn: {result.error}"
                continue
            child.correct = result.value > 0
            if self.terminal_value == "env":
                child.reward = CORRECT if child.correct else WRONG

    def _score(self, steps: list[tuple[Node, Problem]]) -> None:
        """PPM scores of the valid new steps; with terminal_value "ppm" a final answer's score is its value."""
        steps = [(child, problem) for child, problem in steps if child.valid]  # a reward_fn error invalidates
        if self.ppm is None or not steps:
            return
        values = self.ppm.values([self._conversation(problem, child) for child, problem in steps])
        for (child, _), value in zip(steps, values):
            if not math.isfinite(value):
                child.valid, child.error = False, f"PPM score is {value}"
                continue
            child.score = float(value)
            if self.terminal_value == "ppm" and child.terminal and child.reward is None:
                child.reward = child.score

    @staticmethod
    def _conversation(problem: Problem, node: Node) -> list[dict]:
        return [*problem.messages, {"role": "assistant", "content": node.solution()}]
