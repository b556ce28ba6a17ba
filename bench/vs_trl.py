"""rl2 against TRL's GRPOTrainer at equal work: the same tiny model, SFT warm-up, data, reward and settings.

Per size (`demo`: the CPU demo's model, hidden 128, 2 layers, 12 new tokens; `large`: hidden 256, 4 layers,
64 new tokens; `0.5b`: Qwen2.5-0.5B's layers — hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4,864 — with the
demo's 1,024-token vocabulary, 64 new tokens, for `--device cuda`) and process count, three configurations run alternately (same seed and repetition
minutes apart): TRL 1.16's `GRPOTrainer`, rl2 with `rollout.dynamic_filtering=false` (the same 128
trained samples a step as TRL) and rl2's default (groups with equal rewards dropped: fewer trained
samples, same generation). Printed per configuration, medians over the runs: s/step, trained samples/s,
generated tokens/s, the reward over the first and last 6 steps, the final greedy test reward; then the
ratios to TRL on the same processes, and each configuration's reward curve (the mean of every 10 steps).

    pip install -e ".[bench]"
    python bench/vs_trl.py [--sizes demo large] [--procs 1 2] [--seeds 42 7] [--reps 1] [--steps 60]
    python bench/vs_trl.py --device cuda --sizes 0.5b --procs 1 --seeds 42 --steps 20     # one GPU, bf16

On CUDA both libraries compute in bf16 over fp32 weights (TRL `bf16=True`, rl2 `actor.dtype=bfloat16`), and rl2's engine
stays resident while the actor trains (`rollout.sleep=false`: TRL generates with the training model itself, nothing
offloaded); on CPU in fp32.

TRL is a benchmark dependency only (the `bench` extra), never rl2's.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
from demo_runs import python, warm_up  # noqa: E402

PROMPTS, GROUP = 16, 8  # a step: 16 prompts x 8 answers = 128 trained samples at equal work
# At lr 5e-4 the larger model's runs collapsed on both libraries without dynamic filtering (reward 0.15 -> 0, answers
# running to the token limit; TRL and rl2 alike): it trains at 2e-4.
SIZES = {"demo": {"hidden": 128, "layers": 2, "new_tokens": 12, "lr": 5e-4},
         "large": {"hidden": 256, "layers": 4, "new_tokens": 64, "lr": 2e-4},
         "0.5b": {"hidden": 896, "layers": 24, "new_tokens": 64, "lr": 1e-5, "sft_lr": 3e-4,
                  "model_args": ("--heads", "14", "--kv-heads", "2", "--intermediate-size", "4864")}}
SKIP = 3  # warm-up steps left out of the s/step medians
CURVE = 10  # steps per point of the printed reward curves
FAIRNESS = """What is equal: the starting model (one SFT warm-up per size), the train and test prompts, the reward
function (envs/demo_successor.py's), 16 prompts x 8 answers a step, temperature 1, the new-token limit, AdamW
(lr 5e-4, 2e-4 for the larger model, 1e-5 for 0.5b; weight decay 0.01, betas 0.9/0.999, clip 1.0) with 10% linear warm-up then cosine, fp32, no KL, PPO
clip 0.2, one update per batch (on-policy), token-mean loss (TRL's "dapo"), group-normalised advantages with
std epsilon 1e-4 (TRL's), the 128 answers of a step generated in one batch (TRL's generation_batch_size, rl2's
rollout.max_batch_size), the same torch threads (torchrun's 1 per process with 2 processes); fp32 on CPU, bf16
compute over fp32 weights on CUDA, where rl2's engine stays resident (`rollout.sleep=false`; TRL generates with its
training model, nothing offloaded).
What is not: the order prompts are drawn in (each library's own seeded sampler), the random streams, TRL's
padded batches vs rl2's packed rows, TRL's `model.generate` vs rl2's engine (a paged KV cache with continuous
batching; on CUDA with graphs), each library's attention (TRL: the model's sdpa; rl2: packed rows), rl2's test pass at step 0 (not in the s/step medians), TRL's greedy test done here after training
with `model.generate` (rl2's by its own evaluation, the same prompts and reward)."""


# ---- TRL, run as a subprocess of this file --------------------------------------------------------

def trl_worker(args: argparse.Namespace) -> None:
    """One TRL GRPOTrainer run (1 process, or a rank of torchrun); rank 0 writes its summary to args.result."""
    import torch
    from datasets import load_dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, os.path.join(REPO, "envs"))
    from demo_successor import reward_fn

    def reward(prompts, completions, answer, **kwargs) -> list[float]:
        return [reward_fn(prompt + completion, a) for prompt, completion, a in zip(prompts, completions, answer)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends, self.logs = [time.perf_counter()], []

        def on_step_end(self, *unused, **kwargs):
            self.ends.append(time.perf_counter())

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(logs)

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    data = load_dataset("json", data_files=os.path.join(args.data, "train.jsonl"), split="train")
    data = data.rename_column("messages", "prompt")
    config = GRPOConfig(
        output_dir=args.out, use_cpu=args.device == "cpu", seed=args.seed, max_steps=args.steps, report_to="none", save_strategy="no",
        logging_steps=1, per_device_train_batch_size=PROMPTS * GROUP // processes, num_generations=GROUP,
        generation_batch_size=PROMPTS * GROUP, max_completion_length=args.new_tokens, temperature=1.0,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=int(0.1 * args.steps), weight_decay=0.01,
        max_grad_norm=1.0, beta=0.0, loss_type="dapo", scale_rewards="group", bf16=args.device == "cuda",
        gradient_checkpointing=False, dataloader_num_workers=0, disable_dropout=True,
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config, train_dataset=data, callbacks=[clock])
    trainer.train()
    if int(os.environ.get("RANK", "0")) != 0:
        return
    model, tokenizer = trainer.model, AutoTokenizer.from_pretrained(args.model, padding_side="left")
    tests = [json.loads(line) for line in open(os.path.join(args.data, "test.jsonl"))]
    texts = [tokenizer.apply_chat_template(t["messages"], tokenize=False, add_generation_prompt=True) for t in tests]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    model.eval()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    replies = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    test = sum(reward_fn(t["messages"] + [{"role": "assistant", "content": r}], t["answer"]) for t, r in zip(tests, replies))
    step_seconds = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    with open(args.result, "w") as f:
        json.dump({"step_seconds": step_seconds, "rewards": [log["reward"] for log in clock.logs],
                   "lengths": [log["completions/mean_length"] for log in clock.logs],
                   "trained": [PROMPTS * GROUP] * len(step_seconds), "test": test / len(tests)}, f)


def launcher(processes: int) -> list[str]:
    """`python`'s arguments before a script: none for one process, torchrun's for more."""
    return [] if processes == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]


def run_trl(model: str, data: str, out: str, size: dict, processes: int, seed: int, steps: int, device: str) -> dict:
    result = os.path.join(out, "result.json")
    command = [*launcher(processes), os.path.abspath(__file__), "--trl-worker", "--model", model, "--data", data,
               "--out", out, "--result", result, "--seed", str(seed), "--steps", str(steps),
               "--new-tokens", str(size["new_tokens"]), "--lr", str(size["lr"]), "--device", device]
    python(command, os.path.join(out, "log.txt"))
    return json.load(open(result))


# ---- rl2 --------------------------------------------------------------------------------------------

def dtype(device: str) -> str:
    """rl2's compute dtype: what TRL's `bf16` flag gives on CUDA (bf16 compute over fp32 weights), fp32 on CPU."""
    return "bfloat16" if device == "cuda" else "float32"


def rl2_arguments(model: str, data: str, out: str, size: dict, seed: int, steps: int, filtering: bool, device: str,
                  sleep: bool = False) -> list[str]:
    """The `rl2.trainer.ppo` key=value arguments of one rl2 run: TRL's settings (FAIRNESS) in rl2's keys."""
    new = size["new_tokens"]
    return [
        f"data.path={data}/train.jsonl", f"data.test_path={data}/test.jsonl",
        f"data.prompts_per_rollout={PROMPTS}", f"data.responses_per_prompt={GROUP}",
        f"actor.model_name={model}", f"actor.dtype={dtype(device)}", "actor.gradient_checkpointing=false",
        f"actor.lr={size['lr']}", "actor.warmup_ratio=0.1", f"actor.save_dir={out}",
        "rollout.env_path=envs/demo_successor.py", "rollout.max_turns=1",
        f"rollout.train_sampling_params={{temperature: 1.0, max_new_tokens: {new}}}",
        f"rollout.test_sampling_params={{temperature: 0.0, max_new_tokens: {new}}}",
        "adv.estimator=reinforce", "adv.norm_var=true", "adv.std_eps=1e-4", f"rollout.dynamic_filtering={str(filtering).lower()}",
        f"trainer.total_steps={steps}", f"trainer.test_freq={steps}", f"trainer.seed={seed}",
        "trainer.disable_wandb=true", "trainer.dump_trajectories=false",
        f"rollout.max_batch_size={PROMPTS * GROUP}",  # the step's 128 generated at once, as TRL's generation_batch_size
        *(["rollout.sleep=false"] if device == "cuda" and not sleep else []),
    ]


def run_rl2(model: str, data: str, out: str, size: dict, processes: int, seed: int, steps: int, filtering: bool,
            device: str, sleep: bool = False) -> dict:
    command = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", "-m", "rl2.trainer.ppo",
               *rl2_arguments(model, data, out, size, seed, steps, filtering, device, sleep)]
    python(command, os.path.join(out, "log.txt"))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps_rows = [row for row in rows if "time/step" in row]
    return {
        "step_seconds": [row["time/step"] for row in steps_rows],
        "rewards": [row["reward/mean"] for row in steps_rows],
        "lengths": [row["response_length/mean"] for row in steps_rows],
        "trained": [PROMPTS * GROUP * (1 - row.get("dynamic_filter/dropped_ratio", 0.0)) for row in steps_rows],
        "test": [row["test/reward_mean"] for row in rows if "test/reward_mean" in row][-1],
    }


# ---- the table ----------------------------------------------------------------------------------

def summary(run: dict) -> dict:
    seconds = statistics.median(run["step_seconds"][SKIP:])
    trained = statistics.mean(run["trained"][SKIP:])
    return {
        "s_step": seconds,
        "samples_s": trained / seconds,
        "tokens_s": statistics.mean(run["lengths"][SKIP:]) * PROMPTS * GROUP / seconds,
        "first": statistics.mean(run["rewards"][:6]),
        "last": statistics.mean(run["rewards"][-6:]),
        "test": run["test"],
        "curve": [statistics.mean(run["rewards"][i:i + CURVE]) for i in range(0, len(run["rewards"]), CURVE)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["demo", "large"], choices=list(SIZES))
    parser.add_argument("--procs", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 7])
    parser.add_argument("--reps", type=int, default=1, help="repetitions of each (seed, configuration)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--configs", nargs="+", default=["trl", "rl2", "rl2-filtering"],
                        choices=["trl", "rl2", "rl2-filtering", "rl2-sleep"],
                        help="rl2-sleep: equal work with the engine asleep while the actor trains (rl2's default)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both libraries run")
    # the TRL worker's own arguments
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--model", "--data", "--result"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=42, help=argparse.SUPPRESS)
    parser.add_argument("--new-tokens", type=int, default=12, help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, default=5e-4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    try:
        import trl
    except ImportError:
        raise SystemExit('bench/vs_trl.py needs TRL: pip install -e ".[bench]"')
    root = args.out or tempfile.mkdtemp(prefix="rl2-vs-trl-")
    print(f"rl2 vs TRL {trl.__version__} on {args.device}: sizes {args.sizes}, processes {args.procs}, seeds {args.seeds} x {args.reps}, "
          f"{args.steps} steps; runs in {root}", flush=True)
    table = []
    for size_name in args.sizes:
        size = SIZES[size_name]
        base = os.path.join(root, size_name)
        os.makedirs(base, exist_ok=True)
        model = warm_up(base, args.sft_steps, "successor", size["hidden"], size["layers"], size.get("model_args", ()),
                        dtype(args.device), size.get("sft_lr", 3e-3))
        data = os.path.join(base, "data")
        for processes in args.procs:
            runs: dict[str, list[dict]] = {name: [] for name in args.configs}
            for seed in args.seeds:
                for rep in range(args.reps):
                    for name in args.configs:
                        out = os.path.join(base, f"{name}-p{processes}-s{seed}-r{rep}")
                        os.makedirs(out, exist_ok=True)
                        start = time.perf_counter()
                        if name == "trl":
                            run = run_trl(model, data, out, size, processes, seed, args.steps, args.device)
                        else:
                            run = run_rl2(model, data, out, size, processes, seed, args.steps, name == "rl2-filtering",
                                          args.device, sleep=name == "rl2-sleep")
                        row = summary(run)
                        runs[name].append(row)
                        print(f"{size_name:5s} p{processes} seed {seed:3d} rep {rep} {name:14s} {row['s_step']:.3f} s/step, "
                              f"{row['samples_s']:6.1f} samples/s, reward {row['first']:.2f} -> {row['last']:.2f}, "
                              f"test {row['test']:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
            for name, rows in runs.items():
                medians = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "curve"}
                medians["curve"] = [statistics.mean(points) for points in zip(*(r["curve"] for r in rows))]
                table.append((size_name, processes, name, medians))
    print("\nmedians over seeds and repetitions; ratios against TRL on the same size and processes (samples/s)")
    print(f"{'size':5s} {'procs':>5s} {'config':14s} {'s/step':>7s} {'samples/s':>9s} {'tokens/s':>8s} {'first':>6s} "
          f"{'last6':>6s} {'test':>6s} {'vs TRL':>7s}")
    for size_name, processes, name, row in table:
        trl_row = next((r for s, p, n, r in table if (s, p, n) == (size_name, processes, "trl")), None)
        ratio = f"{row['samples_s'] / trl_row['samples_s']:6.2f}x" if trl_row else "     -"
        print(f"{size_name:5s} {processes:5d} {name:14s} {row['s_step']:7.3f} {row['samples_s']:9.1f} {row['tokens_s']:8.0f} "
              f"{row['first']:6.2f} {row['last']:6.2f} {row['test']:6.3f} {ratio:>7s}")
    print(f"\nreward curves: the mean reward of each {CURVE} steps, averaged over seeds and repetitions")
    for size_name, processes, name, row in table:
        print(f"{size_name:5s} {processes:5d} {name:14s} " + " ".join(f"{point:.2f}" for point in row["curve"]))
    print("\n" + FAIRNESS)


if __name__ == "__main__":
    main()
