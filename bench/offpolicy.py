"""The engine/trainer gap on CPU and what each rollout correction does with it, on the GRPO demo task.

The gap is made real: the engine samples in bfloat16 (`rollout.dtype=bfloat16`) while the actor trains in
float32, and each rollout feeds several minibatch updates (`actor.update_per_rollout`). One SFT warm-up
(the demo's), then GRPO from it under each setting and seed, in one run; printed per setting: the reward
(first step, mean of the last steps), the final greedy test reward, the mismatch the corrections see
(KL(behav || prox) by k1 and k3, the share of tokens whose ratio leaves [1/C, C], the largest ratio) and
what they did (rejected tokens, mean importance weight). A setting without the gap (the engine in float32)
is the baseline.

    python bench/offpolicy.py [--seeds 3] [--steps 30] [--settings gap tis mis ...] [--out DIR]
"""

import argparse
import json
import os
import tempfile
import time

from demo_runs import python, warm_up

LAST_STEPS = 5
GAP = ["rollout.dtype=bfloat16", "actor.update_per_rollout=4"]
SETTINGS = {
    "no-gap": ["actor.update_per_rollout=4"],
    "gap": GAP,
    "tis": [*GAP, "actor.rollout_correction=tis"],
    # The demo model's bf16 gap is small (ratios within ~[0.9, 1.2]): at C = 2 every token correction is the
    # plain importance weight. Thresholds this tight make each act on the real gap.
    "tis C=1.02": [*GAP, "actor.rollout_correction=tis", "actor.correction_threshold=1.02"],
    "mis C=1.02": [*GAP, "actor.rollout_correction=mis", "actor.correction_threshold=1.02"],
    "geo_mis C=1.002": [*GAP, "actor.rollout_correction=geo_mis", "actor.correction_threshold=1.002"],
    "icepop .98-1.02": [*GAP, "actor.rollout_correction=icepop", "actor.icepop_low=0.98", "actor.icepop_high=1.02"],
    "decoupled": [*GAP, "actor.rollout_correction=decoupled"],
    "gspo+seq_tis": [*GAP, "actor.policy_loss=gspo", "actor.loss_level=sequence", "actor.rollout_correction=seq_tis"],
    "cispo+tis": [*GAP, "actor.policy_loss=cispo", "actor.rollout_correction=tis"],
}
METRICS = ["offpolicy/kl_k1", "offpolicy/kl_k3", "offpolicy/token_ratio_outside", "offpolicy/max_ratio",
           "offpolicy/rejected_token_ratio", "offpolicy/is_weight_mean"]


def grpo(model: str, out: str, name: str, seed: int, steps: int, extra: list[str]) -> dict:
    save_dir = f"{out}/{name}_seed{seed}"
    start = time.perf_counter()
    python(["-m", "rl2.trainer.ppo", f"data.path={out}/data/train.jsonl", f"data.test_path={out}/data/test.jsonl",
            "data.prompts_per_rollout=16", "data.responses_per_prompt=8", f"actor.model_name={model}",
            "actor.dtype=float32", "actor.gradient_checkpointing=false", "actor.lr=5e-4", "actor.warmup_ratio=0.1",
            f"actor.save_dir={save_dir}", "rollout.env_path=envs/demo_successor.py",
            "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 12}",
            "rollout.test_sampling_params={temperature: 0.0, max_new_tokens: 12}", "adv.estimator=reinforce",
            "adv.norm_var=true", f"trainer.total_steps={steps}", f"trainer.test_freq={steps}", f"trainer.seed={seed}",
            "trainer.disable_wandb=true", "trainer.dump_trajectories=false", *extra], f"{save_dir}.log")
    rows = [json.loads(line) for line in open(f"{save_dir}/metrics.jsonl")]
    rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
    result = {"first": rewards[0], "last": sum(rewards[-LAST_STEPS:]) / len(rewards[-LAST_STEPS:]),
              "test": [row["test/reward_mean"] for row in rows if "test/reward_mean" in row][-1],
              "seconds": time.perf_counter() - start}
    for key in METRICS:
        values = [row[key] for row in rows if key in row]
        result[key] = None if not values else max(values) if key == "offpolicy/max_ratio" else sum(values) / len(values)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="rl2-offpolicy-")
    os.makedirs(out, exist_ok=True)
    print(f"SFT warm-up ({args.sft_steps} steps) in {out}", flush=True)
    model = warm_up(out, args.sft_steps, "successor")
    header = (f"{'setting':<16} {'seed':>4} {'first':>6} {'last':>6} {'test':>6} {'kl_k1':>9} {'kl_k3':>9} "
              f"{'outside':>8} {'max_ratio':>9} {'rejected':>8} {'weight':>7} {'s':>5}")
    print(header, flush=True)
    summary = {}
    for name in args.settings:
        runs = []
        for seed in range(1, args.seeds + 1):
            r = grpo(model, out, name, seed, args.steps, SETTINGS[name])
            runs.append(r)

            def fmt(key: str, width: int, spec: str) -> str:
                return f"{r[key]:>{width}{spec}}" if r[key] is not None else f"{'-':>{width}}"

            print(f"{name:<16} {seed:>4} {r['first']:>6.3f} {r['last']:>6.3f} {r['test']:>6.3f} "
                  f"{fmt('offpolicy/kl_k1', 9, '.2e')} {fmt('offpolicy/kl_k3', 9, '.2e')} "
                  f"{fmt('offpolicy/token_ratio_outside', 8, '.4f')} {fmt('offpolicy/max_ratio', 9, '.3f')} "
                  f"{fmt('offpolicy/rejected_token_ratio', 8, '.4f')} {fmt('offpolicy/is_weight_mean', 7, '.4f')} "
                  f"{r['seconds']:>5.0f}", flush=True)
        summary[name] = {key: sum(r[key] for r in runs) / len(runs) for key in ("last", "test")}
    print("\nmean over seeds: " + ", ".join(f"{name} last {s['last']:.3f} test {s['test']:.3f}"
                                           for name, s in summary.items()))


if __name__ == "__main__":
    main()
