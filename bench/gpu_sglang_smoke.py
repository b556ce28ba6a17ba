"""GPU smoke test and throughput of the SGLang rollout engine, colocated with an FSDP actor.

For anyone with GPUs and SGLang (`pip install -e ".[gpu]"`):

    torchrun --nproc_per_node=2 bench/gpu_sglang_smoke.py --model Qwen/Qwen2.5-0.5B-Instruct --tp-size 2

Steps, in the trainer's order: start the engine (before the actor's optimizer), generate,
compare the engine's log-probs with the actor's; release the engine's memory; one optimizer
step of the actor; push the new weights (timed) and resume; generate again and check that the
engine now agrees with the updated actor (and that the step moved the log-probs, so the
agreement is with new weights). Prints tokens/s, push GB/s, memory released, and exits 1 when
engine and actor disagree beyond --tolerance. Without --model a small random model is built
locally (no download). With PYTHONPATH=tests/sglang_stand_in it runs on CPU against the test
stand-in, which checks this script, not SGLang.
"""

import argparse
import json
import os
import time

import torch
from transformers import AutoTokenizer

from rl2.algorithms.losses import with_loss_weights
from rl2.config import load_config
from rl2.distributed.process_group import (
    all_gather_objects,
    all_reduce_sum,
    barrier,
    device,
    exit_process,
    init_distributed,
    is_rank0,
    rank,
)
from rl2.engines import SamplingParams, build_engine
from rl2.rollout.weight_sync import iter_full_weights
from rl2.testing.tiny import save_tiny
from rl2.workers.policy import Policy

QUESTIONS = [
    "What is 17 * 23? Think step by step.",
    "Write a Python function that reverses a string.",
    "Name three prime numbers larger than 100.",
    "Explain what a hash table is in two sentences.",
]


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        messages = [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids))
    return prompts


def sequences_of(prompts: list[list[int]], generations) -> list[dict[str, torch.Tensor]]:
    return [
        {
            "input_ids": torch.tensor(prompt + g.token_ids),
            "loss_mask": torch.tensor([0.0] * len(prompt) + [1.0] * len(g.token_ids)),
            "engine_logps": torch.tensor([0.0] * len(prompt) + g.logprobs),
        }
        for prompt, g in zip(prompts, generations)
    ]


def mismatch(actor_logps: list[torch.Tensor], sequences: list[dict]) -> tuple[float, float]:
    """Mean and max |actor − engine| log-prob over generated tokens."""
    diff = torch.cat([(a - s["engine_logps"]).abs() * s["loss_mask"] for a, s in zip(actor_logps, sequences)])
    mask = torch.cat([s["loss_mask"] for s in sequences])
    return (diff.sum() / mask.sum().clamp(min=1)).item(), diff.max().item()


def timed_generate(engine, prompts, params) -> tuple[list, float, int]:
    start = time.perf_counter()
    generations = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = int(all_reduce_sum(float(sum(len(g.token_ids) for g in generations))))
    return generations, seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF model name or local path; default: a small local model")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=64, help="prompts per rank")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--memory-fraction", type=float, default=0.5)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest mean |actor − engine| log-prob allowed")
    args = parser.parse_args()

    init_distributed()
    model = args.model
    if model is None:
        model = os.path.join(os.environ.get("TMPDIR", "/tmp"), "rl2_sglang_smoke_model")
        if is_rank0():
            save_tiny(model, hidden_size=256, num_layers=4)
        barrier()
    tokenizer = AutoTokenizer.from_pretrained(model)
    results: dict[str, float | str] = {"model": model, "tp_size": args.tp_size, "device": str(device())}

    start = time.perf_counter()
    engine = build_engine(
        "sglang", model, tokenizer, device(), args.dtype, seed=0,
        tp_size=args.tp_size, memory_fraction=args.memory_fraction,
    )
    results["engine_start_s"] = time.perf_counter() - start
    config = load_config([f"actor.model_name={model}", f"actor.dtype={args.dtype}", f"actor.lr={args.lr}",
                          "actor.gradient_checkpointing=false", "actor.max_grad_norm=1e9"])
    actor = Policy(config.actor, total_steps=1)

    prompts = prompts_for(tokenizer, args.prompts)
    sample = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    generations, seconds, tokens = timed_generate(engine, prompts, sample)
    results["rollout_tokens_per_s"] = tokens / seconds
    sequences = all_gather_objects(sequences_of(prompts, generations))
    results["mismatch_before_mean"], results["mismatch_before_max"] = mismatch(actor.compute(sequences), sequences)

    greedy = SamplingParams(temperature=0.0, max_new_tokens=min(args.max_new_tokens, 64))
    before = all_gather_objects(sequences_of(prompts[:8], engine.generate(prompts[:8], greedy)))

    free_before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    start = time.perf_counter()
    engine.sleep()
    results["release_s"] = time.perf_counter() - start
    if torch.cuda.is_available():
        results["released_gib"] = (torch.cuda.mem_get_info()[0] - free_before) / 2**30

    def likelihood(outputs, batch):  # raise the log-probs of the sampled tokens: a visible change
        return -(outputs["logps"] * batch["loss_weight"]).sum(), {}

    actor.train_step(with_loss_weights(sequences), likelihood)

    weight_bytes = sum(p.numel() * torch.finfo(getattr(torch, args.dtype)).bits // 8 for p in actor.model.parameters())
    start = time.perf_counter()
    engine.update_weights(iter_full_weights(actor.model, args.dtype))
    push = time.perf_counter() - start
    results["push_s"], results["push_gb_per_s"] = push, weight_bytes / push / 1e9
    start = time.perf_counter()
    engine.wake()
    results["resume_s"] = time.perf_counter() - start

    after = all_gather_objects(sequences_of(prompts[:8], engine.generate(prompts[:8], greedy)))
    results["mismatch_after_mean"], results["mismatch_after_max"] = mismatch(actor.compute(after), after)
    # The updated actor on the tokens the old engine generated: how far the step moved log-probs.
    results["step_moved_logps_mean"] = mismatch(actor.compute(before), before)[0]
    _, seconds, tokens = timed_generate(engine, prompts, sample)
    results["rollout_tokens_per_s_after_resume"] = tokens / seconds
    engine.shutdown()

    ok = (
        results["mismatch_before_mean"] < args.tolerance
        and results["mismatch_after_mean"] < args.tolerance
        and results["step_moved_logps_mean"] > results["mismatch_after_mean"]
    )
    if rank() == 0:
        for key, value in results.items():
            print(f"{key:>36}: {value:.4g}" if isinstance(value, float) else f"{key:>36}: {value}")
        print(json.dumps({**results, "ok": ok}))
        print("OK: the engine follows the actor" if ok else "FAILED: engine and actor disagree", flush=True)
    exit_process(0 if ok else 1)  # gloo can abort a finished rank during interpreter teardown


if __name__ == "__main__":
    main()
