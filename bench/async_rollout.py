"""The schedules against the lockstep step, with a slow, long-tailed tool: the multi-turn demo (a `lookup` tool
that knows each box's code) whose tool answers after a lognormal latency (median 0.2 s, 5% over 2 s, like a
remote search or code service).

One SFT warm-up (the tool demo's), then GRPO from it under each schedule, every run on 2 processes (2 ranks
colocated, or 1 training + 1 rollout rank split), over the same data and the same number of trained samples
(steps x prompts_per_rollout x responses_per_prompt), in one run: lockstep; partial rollout; split placement
one-step-off (`rollout.max_staleness=1`) and bounded staleness K = 2, each also with partial rollout on the
rollout rank. Printed per run: trained samples per second of wall time, the wall time until the reward first
reaches the threshold, the final reward (mean of the last steps), what partial rollout carried over, and for
split runs the share of the wall time the trainer and the rollout rank waited.

    python bench/async_rollout.py [--seeds 2] [--steps 24] [--threshold 0.9] [--runs lockstep partial ...] [--out DIR]
"""

import argparse
import json
import os
import tempfile
import time

from demo_runs import REPO, python, warm_up

LAST_STEPS = 5
PROMPTS, RESPONSES = 16, 8

SLOW_LOOKUP_ENV = '''"""The demo's lookup tool, answering after a lognormal latency: median 0.2 s, 5% of the calls over 2 s."""

import asyncio
import math
import random
import sys

sys.path.insert(0, {envs!r})
import demo_lookup  # noqa: E402

SIGMA = math.log(10) / 1.645  # P(latency > 10 x median) = 5%


async def interact(messages):
    await asyncio.sleep(0.2 * math.exp(random.gauss(0.0, SIGMA)))
    return demo_lookup.interact(messages)


def reward_fn(messages, answer):
    return demo_lookup.reward_fn(messages, answer)
'''


SPLIT = ["rollout.placement=split", "rollout.ranks=1"]
RUNS = {
    "lockstep": [],
    "partial": ["rollout.partial_rollout=true"],
    "one-step-off": [*SPLIT, "rollout.max_staleness=1"],
    "staleness-2": [*SPLIT, "rollout.max_staleness=2"],
    "one-step-off+partial": [*SPLIT, "rollout.max_staleness=1", "rollout.partial_rollout=true"],
    "staleness-2+partial": [*SPLIT, "rollout.max_staleness=2", "rollout.partial_rollout=true"],
}


def grpo(model: str, out: str, name: str, seed: int, steps: int, env_file: str, extra: list[str]) -> list[dict]:
    save_dir = f"{out}/{name}_seed{seed}"
    python(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "rl2.trainer.ppo", f"data.path={out}/data/train.jsonl", f"data.prompts_per_rollout={PROMPTS}",
            f"data.responses_per_prompt={RESPONSES}", f"actor.model_name={model}", "actor.dtype=float32",
            "actor.gradient_checkpointing=false", "actor.lr=5e-4", "actor.warmup_ratio=0.1", f"actor.save_dir={save_dir}",
            f"rollout.env_path={env_file}", "rollout.max_turns=2",
            "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 16}", "adv.estimator=reinforce",
            "adv.norm_var=true", f"trainer.total_steps={steps}", f"trainer.seed={seed}", "trainer.disable_wandb=true",
            "trainer.dump_trajectories=false", *extra], f"{save_dir}.log")
    return [json.loads(line) for line in open(f"{save_dir}/metrics.jsonl")]


def summary(rows: list[dict], threshold: float) -> dict:
    """Throughput and learning of one run, from its metrics (wall time = the sum of its step times)."""
    times = [row["time/step"] if "time/step" in row else sum(v for k, v in row.items() if k.startswith("time/"))
             for row in rows]
    rewards = [row.get("reward/mean", 0.0) for row in rows]
    elapsed, reached = 0.0, None
    for step_time, reward in zip(times, rewards):
        elapsed += step_time
        if reached is None and reward >= threshold:
            reached = elapsed
    samples = len(rows) * PROMPTS * RESPONSES
    last = rows[-1]
    return {"samples_per_s": samples / sum(times), "seconds": sum(times), "to_threshold": reached,
            "final": sum(rewards[-LAST_STEPS:]) / len(rewards[-LAST_STEPS:]),
            "resumed": sum(row.get("partial/resumed_ratio", 0.0) for row in rows) / len(rows),
            "age_max": max(row.get("partial/age_max", 0.0) + row.get("async/staleness", 0.0) for row in rows),
            "trainer_idle": last.get("async/trainer_idle", 0.0) / sum(times),
            "rollout_idle": last.get("async/rollout_idle", 0.0) / sum(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="rl2-async-")
    os.makedirs(out, exist_ok=True)
    env_file = f"{out}/slow_lookup.py"
    with open(env_file, "w") as f:
        f.write(SLOW_LOOKUP_ENV.format(envs=os.path.join(REPO, "envs")))
    print(f"SFT warm-up ({args.sft_steps} steps) in {out}", flush=True)
    start = time.perf_counter()
    model = warm_up(out, args.sft_steps, "lookup")
    print(f"warm-up {time.perf_counter() - start:.0f} s", flush=True)
    print(f"{'run':<21} {'seed':>4} {'samples/s':>9} {'wall s':>7} {'to ' + str(args.threshold):>8} {'final':>6} "
          f"{'resumed':>7} {'age_max':>7} {'t_idle':>6} {'r_idle':>6}", flush=True)
    means: dict[str, list[dict]] = {}
    for seed in range(1, args.seeds + 1):
        for name in args.runs:
            s = summary(grpo(model, out, name, seed, args.steps, env_file, RUNS[name]), args.threshold)
            means.setdefault(name, []).append(s)
            reached = f"{s['to_threshold']:.0f}" if s["to_threshold"] is not None else "never"
            print(f"{name:<21} {seed:>4} {s['samples_per_s']:>9.1f} {s['seconds']:>7.0f} {reached:>8} {s['final']:>6.3f} "
                  f"{s['resumed']:>7.3f} {s['age_max']:>7.0f} {s['trainer_idle']:>6.2f} {s['rollout_idle']:>6.2f}",
                  flush=True)
    rate = {name: sum(s["samples_per_s"] for s in runs) / len(runs) for name, runs in means.items()}
    final = {name: sum(s["final"] for s in runs) / len(runs) for name, runs in means.items()}
    print()
    for name in means:
        print(f"{name:<21} {rate[name] / rate[args.runs[0]]:.2f}x {args.runs[0]}'s samples per second, final reward "
              f"{final[name]:.3f}")


if __name__ == "__main__":
    main()
