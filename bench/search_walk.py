"""Tree search where the policy must explore: reach a target sum in three steps (tests/search_task.py;
greedy decoding always adds 1, so it solves no target above 3).

    python bench/search_walk.py [--seeds 3] [--problems 24]

Per round-1 seed: greedy vs terminal-guided MCTS (8 rollouts of 3 candidates) on the training
problems; a Bradley-Terry PPM fitted on MCTS's step-level pairs; then, on fresh samples, step-level
beam search (beam 2, width 2) vs best-of-4, both choosing the answer by that PPM. Accuracy is the
share of problems whose chosen answer is right; tokens are generated tokens per problem.
"""

import argparse
import os
import sys
import tempfile

from transformers import AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from search_task import TabularPPM, run_walk  # noqa: E402

from rl2.rollout.env import Env  # noqa: E402
from rl2.search.beam import BeamSearch  # noqa: E402
from rl2.search.best_of_n import BestOfN  # noqa: E402
from rl2.search.mcts import MCTS  # noqa: E402
from rl2.search.training_data import ppm_pairs  # noqa: E402
from rl2.search.tree import Node  # noqa: E402
from rl2.testing.tiny import save_tiny  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--problems", type=int, default=24)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, Env(os.path.join(HERE, "..", "tests", "envs", "boxed_equals.py")) as env:
        tokenizer = AutoTokenizer.from_pretrained(save_tiny(os.path.join(folder, "model")))
        targets = [5 + i % 4 for i in range(args.problems)]
        print(f"{args.problems} problems (targets 5-8, 3 steps); accuracy / generated tokens per problem")
        print("seed |  greedy  |   mcts   | pairs | eval seed |    beam+PPM    | best-of-4+PPM")
        for seed in range(args.seeds):
            greedy, greedy_tokens, _, _ = run_walk(tokenizer, env, lambda: BestOfN(Node(), n=1), targets, seed, greedy=True)
            mcts, mcts_tokens, agents, problems = run_walk(
                tokenizer, env, lambda: MCTS(Node(), rollouts=8, width=3, c=2.0), targets, seed)
            pairs = [row for agent, problem in zip(agents, problems) for row in ppm_pairs(agent.root, problem.messages)]
            ppm = TabularPPM(pairs)
            for eval_seed in (seed + 1, seed + 5):
                beam, beam_tokens, _, _ = run_walk(tokenizer, env, lambda: BeamSearch(Node(), beam_size=2, width=2),
                                                   targets, eval_seed, ppm=ppm, terminal_value="ppm")
                best, best_tokens, _, _ = run_walk(tokenizer, env, lambda: BestOfN(Node(), n=4), targets, eval_seed,
                                                   ppm=ppm, terminal_value="ppm")
                print(f"{seed:4d} | {greedy:.2f} {greedy_tokens:4.0f} | {mcts:.2f} {mcts_tokens:4.0f} | {len(pairs):5d} | "
                      f"{eval_seed:9d} | {beam:.2f} {beam_tokens:4.0f}      | {best:.2f} {best_tokens:4.0f}", flush=True)


if __name__ == "__main__":
    main()
