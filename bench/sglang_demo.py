"""The GRPO demo on each rollout engine: `hf`, the real SGLang on CPU (one engine per rank; one TP=2 engine that both
ranks share; one per rank kept resident, `sglang-awake`) and vLLM, from one SFT warm-up with the same seeds, one after
the other.

`recipes/ppo_tiny.sh` (TASK=successor) on `--ranks` ranks: the warm-up once (SFT seed `--seed`, or `--sft-ckpt`),
then GRPO from it per engine, each launched by its venv's torchrun (`make sglang-venv`, `make test-vllm`'s venv); an
engine whose venv is missing is skipped. Printed per run: the first step's reward, the last-6 reward (the mean of the
last 6 steps' reward/mean), the greedy test reward before (step 0) and after (the last step), the median seconds a
step (`time/step`, the sum of the step's phases), the GRPO loop's seconds a step (its progress bar's time over the
steps: the evaluations and anything no phase times included), and the engine/actor log-prob gap after the weight
pushes (`logp_mismatch` mean and max over steps 2..: step 1 samples from the checkpoint the engine loaded).

    python bench/sglang_demo.py [--engines hf sglang sglang-tp2 sglang-awake vllm] [--steps 60] [--out DIR] [key=value ...]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAST_STEPS = 6
ENGINES = {  # name: (venv, PPO arguments)
    "hf": (None, ["rollout.engine=hf"]),
    "sglang": (".venv-sglang", ["rollout.engine=sglang"]),
    "sglang-tp2": (".venv-sglang", ["rollout.engine=sglang", "rollout.tp_size=2"]),
    # The engine kept resident while the actor trains: no release/resume of SGLang's memory (seconds a step on CPU).
    "sglang-awake": (".venv-sglang", ["rollout.engine=sglang", "rollout.sleep=false"]),
    "vllm": (".venv-vllm", ["rollout.engine=vllm", "rollout.gpu_memory_utilization=0.05"]),
}


def demo(out: str, venv: str | None, ranks: int, seed: int, steps: int, sft_ckpt: str | None, args: list[str]) -> None:
    """recipes/ppo_tiny.sh in `out` (its warm-up alone when `steps` is 0), torchrun from `venv`'s python."""
    python = os.path.join(REPO, venv, "bin", "python") if venv else "python"
    env = {**os.environ, "OUT": out, "NPROC": str(ranks), "SEED": str(seed), "PPO_STEPS": str(steps),
           "TORCHRUN": f"{python} -m torch.distributed.run", "WANDB_MODE": "disabled",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **({"SFT_CKPT": sft_ckpt} if sft_ckpt else {})}
    # One CPU share per local rank for SGLang's CPU engines: it indexes SGLANG_CPU_OMP_THREADS_BIND by gpu_id (the
    # rank's local index), and without it by NUMA node, which a one-engine-per-rank run on one node does not have.
    cores = sorted(os.sched_getaffinity(0))
    env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(cores[i % len(cores)]) for i in range(ranks)))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "log.txt"), "w") as log:
        done = subprocess.run(["bash", "recipes/ppo_tiny.sh", "trainer.dump_trajectories=false", *args],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}, see {out}/log.txt")


def loop_seconds(log: str) -> float | None:
    """The GRPO loop's seconds from its progress bar's last line ("PPO: 100%|...| 60/60 [07:52<00:00"):
    every step's whole time, the evaluations included."""
    ends = re.findall(r"PPO: 100%\|[^|]*\| *\d+/\d+ \[(?:(\d+):)?(\d+):(\d+)<", open(log, errors="replace").read())
    if not ends:
        return None
    hours, minutes, seconds = ends[-1]
    return 3600 * int(hours or 0) + 60 * int(minutes) + int(seconds)


def figures(out: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(out, "ppo", "metrics.jsonl"))]
    steps = [row for row in rows if row["step"] > 0 and "reward/mean" in row]
    rewards = [row["reward/mean"] for row in steps]
    tests = [(row["step"], row["test/reward_mean"]) for row in rows if "test/reward_mean" in row]
    pushed = [row for row in steps if row["step"] > 1 and "logp_mismatch/max" in row]
    return {
        "first": rewards[0],
        "last": sum(rewards[-LAST_STEPS:]) / len(rewards[-LAST_STEPS:]),
        "test_before": tests[0][1] if tests and tests[0][0] == 0 else None,
        "test_after": tests[-1][1] if tests else None,
        "step_s": statistics.median(row["time/step"] for row in steps if "time/step" in row),
        "loop_s": (lambda total: total / len(steps) if total else None)(loop_seconds(os.path.join(out, "log.txt"))),
        "mismatch_mean": sum(row["logp_mismatch/mean"] for row in pushed) / len(pushed) if pushed else None,
        "mismatch_max": max(row["logp_mismatch/max"] for row in pushed) if pushed else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42, help="seeds the warm-up and GRPO")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sft-ckpt", default=None, help="start every run from this warm-up instead of running one")
    parser.add_argument("--out", default=None)
    args, ppo_args = parser.parse_known_args()
    root = args.out or tempfile.mkdtemp(prefix="rl2-sglang-demo-")
    ckpt = args.sft_ckpt
    if ckpt is None:
        print(f"SFT warm-up (200 steps, {args.ranks} ranks, seed {args.seed}) in {root}/warmup", flush=True)
        demo(f"{root}/warmup", None, args.ranks, args.seed, 0, None, [])
        ckpt = f"{root}/warmup/sft/step200"
    print(f"GRPO {args.steps} steps on {args.ranks} ranks from {ckpt}, seed {args.seed}; runs in {root}", flush=True)
    print(f"{'engine':<11} {'first':>6} {'last-6':>6} {'test':>11} {'s/step':>7} {'loop':>5} {'mismatch mean':>13} "
          f"{'max':>8} {'wall s':>6}", flush=True)
    for name in args.engines:
        venv, extra = ENGINES[name]
        if venv and not os.path.exists(os.path.join(REPO, venv, "bin", "python")):
            print(f"{name:<11} skipped: no {venv}", flush=True)
            continue
        start = time.perf_counter()
        try:
            demo(f"{root}/{name}", venv, args.ranks, args.seed, args.steps, ckpt, [*extra, *ppo_args])
        except RuntimeError as error:
            print(f"{name:<11} FAILED: {error}", flush=True)
            continue
        r = figures(f"{root}/{name}")

        def fmt(value: float | None, spec: str) -> str:
            return "-" if value is None else format(value, spec)

        test = f"{fmt(r['test_before'], '.3f')} -> {fmt(r['test_after'], '.3f')}"
        print(f"{name:<11} {r['first']:>6.3f} {r['last']:>6.3f} {test:>11} {r['step_s']:>7.2f} "
              f"{fmt(r['mismatch_mean'], '.2e'):>13} {fmt(r['mismatch_max'], '.2e'):>8} "
              f"{time.perf_counter() - start:>6.0f}", flush=True)


if __name__ == "__main__":
    main()
