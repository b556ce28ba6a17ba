"""Tree search over a dataset: `[torchrun --nproc_per_node=N] python -m rl2.search key=value ...`.

Every problem of `data.path` (RL rows: `{"messages", "answer"}`) is solved by each search in
`search.modes` with the policy `actor.model_name` served by `rollout.engine` (sampling with
`rollout.train_sampling_params`; greedy with `rollout.test_sampling_params`), steps executed in the
sandbox, final answers checked by `rollout.env_path`'s `reward_fn`, steps scored by `search.ppm_path`
when set. Problems are split over ranks and the results gathered. For each mode, rank 0 writes to
`search.output_dir/<mode>/`:

    solutions.jsonl  per problem: the chosen solution, whether it is correct, tokens spent
    trees.jsonl      per problem: the whole search tree (text, visits, Q, PPM score, validity)
    sft.jsonl        SFT rows: the best correct solutions (rl2.trainer.sft data)
    ppm_pairs.jsonl  step-level preference pairs (rl2.trainer.rm data, for the PPM)

and `search.output_dir/report.json`: per mode, accuracy (the chosen solution is correct), solved
(some finished solution is correct), generated tokens per problem and generate calls.
"""

import dataclasses
import json
import logging
import math
import os
import time

from tqdm import tqdm

from rl2.config import Config
from rl2.config_checks import check_config
from rl2.data.conversations import RLDataset
from rl2.data.rows import Columns, write_json, write_jsonl
from rl2.distributed.process_group import (
    all_gather_objects,
    device,
    is_rank0,
    rank,
    rank_slice,
    world_size,
)
from rl2.engines import Engine, SamplingParams, build_engine_from_config, check_sglang
from rl2.rollout.env import Env
from rl2.search.agent import SearchAgent
from rl2.search.beam import BeamSearch
from rl2.search.best_of_n import BestOfN
from rl2.search.mcts import MCTS
from rl2.search.ppm import ProcessPreferenceModel
from rl2.search.solver import Problem, Solver, sandbox_runner
from rl2.search.steps import StepFormat
from rl2.search.training_data import ppm_pairs, sft_rows
from rl2.search.tree import Node, tree_to_json
from rl2.tools.sandbox import RunResult, Sandbox
from rl2.trainer.base import run_main, start_run

logger = logging.getLogger("rl2.search")


def make_agent(mode: str, root: Node, config: Config) -> SearchAgent:
    search = config.search
    if mode == "mcts":
        return MCTS(root, search.rollouts, search.width, search.c, search.selection)
    if mode == "beam":
        return BeamSearch(root, search.beam_size, search.width)
    return BestOfN(root, 1 if mode == "greedy" else search.n)


def no_programs(programs: list[str]) -> list[RunResult]:
    """`search.execute_code=false`: every program counts as run, with no output."""
    return [RunResult("", "", 0, 0.0, "ok") for _ in programs]


class SearchRun:
    """The engine, env, sandbox and PPM of one `python -m rl2.search` run, and the runs of each mode."""

    def __init__(self, config: Config):
        check_config(config, "search")
        self.tokenizer = start_run(config)
        if config.rollout.engine == "sglang":
            check_sglang(config.rollout.tp_size)
        self.config = config
        self.env = Env.from_config(config.rollout)
        self.max_length = config.data.max_length
        self.data = RLDataset(config.data.path, self.tokenizer, self.max_length, columns=Columns.from_config(config.data))
        search = config.search
        self.fmt = StepFormat(search.step_end, search.answer_end, search.max_output_chars)
        self.sandbox, self.run_programs = None, no_programs
        if search.execute_code:
            self.sandbox = Sandbox(workers=search.sandbox_workers, timeout=search.code_timeout,
                                   memory_mb=search.code_memory_mb)
            self.run_programs = sandbox_runner(self.sandbox)
        self.ppm = ProcessPreferenceModel(search.ppm_path, device=str(device())) if search.ppm_path else None
        self.engine: Engine = build_engine_from_config(config.rollout, config.actor, self.tokenizer, config.trainer.seed)

    def solver(self, mode: str) -> Solver:
        search, rollout = self.config.search, self.config.rollout
        sampling = rollout.test_sampling_params if mode == "greedy" else rollout.train_sampling_params
        params = dataclasses.replace(SamplingParams.from_dict(sampling), max_new_tokens=search.max_step_tokens)
        lockstep = self.engine.lockstep
        return Solver(
            self.engine, self.tokenizer, params, self.env, self.run_programs, self.fmt, ppm=self.ppm,
            terminal_value=search.terminal_value, max_depth=search.max_depth, max_length=self.max_length,
            any_rank_pending=(lambda pending: any(all_gather_objects([pending]))) if lockstep else None,
        )

    def run_mode(self, mode: str, mode_index: int) -> dict:
        """Search every problem of this rank's share with `mode`; every rank gets all the results."""
        config = self.config
        start, end = rank_slice(len(self.data))
        chunk = config.data.prompts_per_rollout or max(len(self.data), 1)
        chunks = math.ceil(math.ceil(len(self.data) / world_size()) / chunk)  # the same on every rank
        self.engine.reseed((config.trainer.seed + mode_index) * 1_000_003 + rank())
        solver = self.solver(mode)
        records = []
        began = time.time()
        progress = tqdm(total=len(self.data), desc=f"search {mode}", disable=not is_rank0())
        for c in range(chunks):
            indices = list(range(start + c * chunk, min(start + (c + 1) * chunk, end)))
            problems = [Problem(self.data[i]["messages"], self.data[i]["answer"]) for i in indices]
            agents = [make_agent(mode, Node(), config) for _ in problems]
            solver.solve(problems, agents)
            records += [self.record(i, problem, agent) for i, problem, agent in zip(indices, problems, agents)]
            progress.update(len(all_gather_objects(indices)))
        progress.close()
        records = all_gather_objects(records)
        summary = summarize(records, solver.generate_calls, time.time() - began)
        if is_rank0():
            write_mode_outputs(os.path.join(config.search.output_dir, mode), records)
        return summary

    def record(self, index: int, problem: Problem, agent: SearchAgent) -> dict:
        search = self.config.search
        chosen = agent.answer()
        terminals = [node for node in agent.root.walk() if node.terminal and node.valid]
        return {
            "row": self.data.indices[index] + 1,
            "answer": problem.answer,
            "solution": chosen.solution() if chosen is not None else None,
            "correct": bool(chosen is not None and chosen.correct),
            "solved": any(node.correct for node in terminals),
            "finished": len(terminals),
            "invalid_steps": sum(not node.valid for node in agent.root.walk()),
            "tokens": agent.tokens,
            "tree": tree_to_json(agent.root),
            "sft": sft_rows(agent.root, problem.messages, search.sft_per_problem),
            "pairs": ppm_pairs(agent.root, problem.messages, search.pairs_per_side),
        }

    def run(self) -> dict:
        report = {}
        try:
            for mode_index, mode in enumerate(self.config.search.modes):
                report[mode] = self.run_mode(mode, mode_index)
                logger.info(f"{mode}: " + ", ".join(f"{key} {value:.4g}" for key, value in report[mode].items()))
        finally:
            self.close()
        if is_rank0():
            write_json(os.path.join(self.config.search.output_dir, "report.json"),
                       {"model": self.config.actor.model_name, "data": self.config.data.path,
                        "ppm": self.config.search.ppm_path, "modes": report})
            print(json.dumps(report), flush=True)
        return report

    def close(self) -> None:
        self.env.close()
        if self.sandbox is not None:
            self.sandbox.close()
        self.engine.shutdown()


def summarize(records: list[dict], generate_calls: int, seconds: float) -> dict:
    n = max(len(records), 1)
    return {
        "problems": float(len(records)),
        "accuracy": sum(r["correct"] for r in records) / n,
        "solved": sum(r["solved"] for r in records) / n,
        "tokens_per_problem": sum(r["tokens"] for r in records) / n,
        "invalid_steps_per_problem": sum(r["invalid_steps"] for r in records) / n,
        "sft_rows": float(sum(len(r["sft"]) for r in records)),
        "ppm_pairs": float(sum(len(r["pairs"]) for r in records)),
        "generate_calls": float(generate_calls),
        "seconds": seconds,
    }


def write_mode_outputs(folder: str, records: list[dict]) -> None:
    keys = ("row", "answer", "solution", "correct", "solved", "finished", "invalid_steps", "tokens")
    write_jsonl(os.path.join(folder, "solutions.jsonl"), [{key: r[key] for key in keys} for r in records])
    write_jsonl(os.path.join(folder, "trees.jsonl"), [{"row": r["row"], "tree": r["tree"]} for r in records])
    write_jsonl(os.path.join(folder, "sft.jsonl"), [row for r in records for row in r["sft"]])
    write_jsonl(os.path.join(folder, "ppm_pairs.jsonl"), [row for r in records for row in r["pairs"]])


def main() -> None:
    run_main(lambda config: SearchRun(config).run(), "search")
