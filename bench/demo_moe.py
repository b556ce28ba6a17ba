"""The mixture-of-experts demo under each routing replay: `recipes/ppo_moe_tiny.sh` (what `make demo-moe` runs) for
actor.router_replay in off, r2, r3, all from one SFT warm-up; prints each run's greedy test reward before and after
GRPO, its sampled reward over the first and last steps, and the means of router/mismatch, router/load_max and
time/step over the steps that updated (a step whose groups all got equal rewards trains nothing and logs none).
A run that fails prints its error.

    python bench/demo_moe.py [--modes off r2 r3] [--ranks 2] [--seed 42] [--out DIR] [key=value ...]

Extra arguments go to the PPO trainer.
"""

import argparse
import json
import os
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_LAST = 5  # steps averaged for the first and last sampled reward


def run_recipe(out: str, env: dict[str, str], args: list[str]) -> tuple[int, float]:
    """`recipes/ppo_moe_tiny.sh` into `out` with `env` added; its exit status and seconds (output in out/log.txt)."""
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "OUT": out, "WANDB_MODE": "disabled",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    start = time.perf_counter()
    with open(os.path.join(out, "log.txt"), "w") as log:
        done = subprocess.run(["bash", "recipes/ppo_moe_tiny.sh", *args], stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=REPO)
    return done.returncode, time.perf_counter() - start


def last_error(log: str) -> str:
    """The error `log` ends with: rl2's message if it has one, else the last line naming an error other than
    torchrun's (or its last line)."""
    lines = [line.strip() for line in open(log) if line.strip()]
    ours = [line for line in lines if line.startswith("rl2: error")]
    errors = [line for line in lines if "Error" in line and "ChildFailedError" not in line]
    return (ours or errors or lines or ["(no output)"])[-1][:300]


def summary(metrics: str) -> dict:
    """Test and sampled rewards, router metrics and step time of one run's metrics.jsonl."""
    rows = [json.loads(line) for line in open(metrics)]

    def mean(key: str, among: list[dict]) -> float:
        values = [row[key] for row in among if key in row]
        return sum(values) / len(values) if values else float("nan")

    tests = [row["test/reward_mean"] for row in rows if "test/reward_mean" in row]
    steps = [row for row in rows if "reward/mean" in row]
    return {
        "test_start": tests[0],
        "test_end": tests[-1],
        "reward_first": mean("reward/mean", steps[:FIRST_LAST]),
        "reward_last": mean("reward/mean", steps[-FIRST_LAST:]),
        "mismatch": mean("router/mismatch", steps),
        "load_max": mean("router/load_max", steps),
        "seconds_per_step": mean("time/step", steps),
        "updated": sum("router/load_max" in row for row in steps),
        "steps": len(steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["off", "r2", "r3"], choices=["off", "r2", "r3"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--ppo-steps", type=int, default=30)
    parser.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    args, ppo_args = parser.parse_known_args()
    root = args.out or tempfile.mkdtemp(prefix="rl2-demo-moe-")
    common = {"NPROC": str(args.ranks), "SEED": str(args.seed), "SFT_STEPS": str(args.sft_steps)}
    print(f"MoE demo, modes {args.modes}, {args.ranks} ranks, seed {args.seed}, {args.ppo_steps} GRPO steps; "
          f"PPO overrides: {' '.join(ppo_args) or '(none)'}; runs in {root}", flush=True)
    warmup = os.path.join(root, "warmup")
    status, seconds = run_recipe(warmup, {**common, "PPO_STEPS": "0"}, [])
    if status != 0:
        raise SystemExit(f"the warm-up failed (exit {status}): {last_error(os.path.join(warmup, 'log.txt'))}")
    print(f"warm-up: {args.sft_steps} SFT steps in {seconds:.0f}s", flush=True)
    checkpoint = os.path.join(warmup, "sft", f"step{args.sft_steps}")
    print(f"{'replay':6s}  test start -> end   reward first{FIRST_LAST} -> last{FIRST_LAST}   router/mismatch   "
          f"router/load_max   s/step   (steps that updated: the means' steps)")
    for mode in args.modes:
        out = os.path.join(root, mode)
        env = {**common, "ROUTER_REPLAY": mode, "PPO_STEPS": str(args.ppo_steps), "SFT_CKPT": checkpoint}
        status, seconds = run_recipe(out, env, ["trainer.dump_trajectories=false", *ppo_args])
        if status != 0:
            print(f"{mode:6s}  FAILS (exit {status}, {seconds:.0f}s): {last_error(os.path.join(out, 'log.txt'))}",
                  flush=True)
            continue
        s = summary(os.path.join(out, "ppo", "metrics.jsonl"))
        mismatch = f"{s['mismatch']:.4f}" if s["mismatch"] == s["mismatch"] else "-"  # nan without replay
        print(f"{mode:6s}  {s['test_start']:.3f} -> {s['test_end']:.3f}      {s['reward_first']:.3f} -> "
              f"{s['reward_last']:.3f}           {mismatch:>8s}          {s['load_max']:.3f}        "
              f"{s['seconds_per_step']:.2f}    ({s['updated']} of {s['steps']})", flush=True)


if __name__ == "__main__":
    main()
