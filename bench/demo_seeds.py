"""Do the CPU RL demos learn on every seed and rank count? `recipes/ppo_tiny.sh` (SFT warm-up, then GRPO; tasks
successor, lookup, tools) and `recipes/ppo_vision_tiny.sh` (task vision: a tiny VLM learns to count shapes) run over
seeds x rank counts x tasks; prints each run and the share that learn.

A run learns when its mean reward over the last 6 steps and its final test reward (greedy) reach the task's
thresholds (LEARNS: 0.8 and 0.9; vision 0.7 and 0.85, its colour questions right after the warm-up and its counting
not solved everywhere in 300 steps, bench/RESULTS.md). Each line also shows the warm-up's final SFT loss (mean of its
last 20 steps; ~0.06 when the text warm-up learned the task's facts): a run that fails after a poor warm-up is the
warm-up's failure. SEED seeds both the warm-up and GRPO (with --sft-ckpt, GRPO only: every run starts from that
warm-up); the model's initial weights and the data are the demo's. --sft-steps and --ppo-steps default to the
recipe's (text 200 and 60, tools 400; vision 250 and 300). Extra arguments go to the PPO trainer (e.g.
`actor.lr=1e-3` to try another setting).

    python bench/demo_seeds.py [--seeds 10] [--ranks 1 2] [--tasks successor lookup vision] [--out DIR] [key=value ...]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAST_STEPS = 6
LEARNS = {"successor": (0.8, 0.9), "lookup": (0.8, 0.9), "tools": (0.8, 0.9), "vision": (0.7, 0.85)}  # reward, test
RECIPES = {"vision": "recipes/ppo_vision_tiny.sh"}  # the others: recipes/ppo_tiny.sh with TASK


def run_demo(task: str, ranks: int, seed: int, out: str, ppo_args: list[str], sft_steps: int | None,
             ppo_steps: int | None, sft_ckpt: str | None = None) -> dict:
    """One run of the demo (from the warm-up `sft_ckpt` if given; step counts None: the recipe's); its reward
    curve summary and whether it learned."""
    env = {**os.environ, "TASK": task, "NPROC": str(ranks), "SEED": str(seed), "OUT": out,
           **({"SFT_CKPT": sft_ckpt} if sft_ckpt else {}),
           **({"SFT_STEPS": str(sft_steps)} if sft_steps is not None else {}),
           **({"PPO_STEPS": str(ppo_steps)} if ppo_steps is not None else {}), "WANDB_MODE": "disabled",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    recipe = RECIPES.get(task, "recipes/ppo_tiny.sh")
    with open(os.path.join(out, "log.txt"), "w") as log:
        done = subprocess.run(["bash", recipe, "trainer.dump_trajectories=false", *ppo_args],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if done.returncode != 0:
        return {"ok": False, "error": f"exit {done.returncode}, see {out}/log.txt", "seconds": time.perf_counter() - start}
    warm_up = os.path.join(sft_ckpt, "..", "metrics.jsonl") if sft_ckpt else os.path.join(out, "sft", "metrics.jsonl")
    min_reward, min_test = LEARNS[task]
    sft_losses = [json.loads(line)["loss"] for line in open(warm_up)]
    rows = [json.loads(line) for line in open(os.path.join(out, "ppo", "metrics.jsonl"))]
    rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
    tests = [row["test/reward_mean"] for row in rows if "test/reward_mean" in row]
    last = sum(rewards[-LAST_STEPS:]) / len(rewards[-LAST_STEPS:])
    return {
        "ok": True,
        "sft_loss": sum(sft_losses[-20:]) / len(sft_losses[-20:]),
        "first": rewards[0],
        "last": last,
        "test_start": tests[0],
        "test": tests[-1],
        "steps": len(rewards),
        "learned": last >= min_reward and tests[-1] >= min_test,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="seeds 1..N")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tasks", nargs="+", default=["successor", "lookup"], choices=list(LEARNS))
    parser.add_argument("--sft-steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--ppo-steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--sft-ckpt", default=None, help="one warm-up for every run (its checkpoint folder, e.g. "
                        "outputs/ppo_tiny_successor/sft/step200): SEED then seeds GRPO only")
    args, ppo_args = parser.parse_known_args()
    root = args.out or tempfile.mkdtemp(prefix="rl2-demo-seeds-")
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    print(f"demo over seeds {seeds.start}..{seeds.stop - 1}, ranks {args.ranks}, tasks {args.tasks}; "
          f"learns = last-{LAST_STEPS}-step reward and final test reward >= "
          f"{', '.join(f'{task} {LEARNS[task][0]}, {LEARNS[task][1]}' for task in args.tasks)}; "
          f"PPO overrides: {' '.join(ppo_args) or '(none)'}; runs in {root}", flush=True)
    summary = []
    for task in args.tasks:
        for ranks in args.ranks:
            learned = 0
            for seed in seeds:
                out = os.path.join(root, f"{task}-n{ranks}-s{seed}")
                os.makedirs(out, exist_ok=True)
                result = run_demo(task, ranks, seed, out, ppo_args, args.sft_steps, args.ppo_steps, args.sft_ckpt)
                learned += result.get("learned", False)
                if result["ok"]:
                    print(f"{task:9s} ranks {ranks} seed {seed:3d}: warm-up loss {result['sft_loss']:.3f}, reward {result['first']:.3f} -> last-{LAST_STEPS} "
                          f"{result['last']:.3f}, test {result['test_start']:.3f} -> {result['test']:.3f}  "
                          f"{'learns' if result['learned'] else 'FAILS'}  ({result['steps']} steps, {result['seconds']:.0f}s)",
                          flush=True)
                else:
                    print(f"{task:9s} ranks {ranks} seed {seed:3d}: ERROR {result['error']}", flush=True)
            summary.append((task, ranks, learned))
    print("\nshare that learn:")
    for task, ranks, learned in summary:
        print(f"  {task:9s} {ranks} rank{'s' if ranks > 1 else ' '}: {learned}/{len(seeds)}")
    sys.exit(0 if all(learned == len(seeds) for *_, learned in summary) else 1)


if __name__ == "__main__":
    main()
