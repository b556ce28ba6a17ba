"""rl2's SGLangEngine against the real SGLang on CPU, in one process: start it on a tiny fp32 Qwen2, generate, and
compare its log-probs with an HF fp32 forward of the same weights; then push changed weights (sleep,
update_weights, wake) and compare again. For checking an SGLang version's venv (`make sglang-venv`), e.g.

    .venv-sglang-0.5.23/bin/python bench/sglang_cpu_check.py [--model DIR]

Prints the engine start time, per phase the greedy tokens' agreement with HF's argmax and max |engine - HF|
log-prob (greedy, and sampled at temperature 1), how far the push moved HF's log-probs (so the agreement after it
is with the new weights), and the seconds of sleep, update_weights and wake; exits 1 when a gap exceeds --tolerance.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl2.engines import SamplingParams
from rl2.engines.sglang import SGLangEngine

PROMPTS = [[5, 9, 13, 2, 44], [7, 7, 8], list(range(20, 60)), [101, 3, 250, 17, 9, 9, 64, 12]]


def hf_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / T) of the HF model (T = 1 for greedy): what rl2's actor computes."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def compare(engine: SGLangEngine, model) -> dict:
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True))
    argmax_same, greedy_gap, sampled_gap = 0, 0.0, 0.0
    for prompt, g in zip(PROMPTS, greedy):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1:-1]
        argmax_same += int(logits.argmax(-1).tolist() == g.token_ids)
        greedy_gap = max(greedy_gap, (torch.tensor(g.logprobs) - hf_logprobs(model, prompt, g.token_ids, 1.0)).abs().max().item())
    for prompt, g in zip(PROMPTS, sampled):
        sampled_gap = max(sampled_gap, (torch.tensor(g.logprobs) - hf_logprobs(model, prompt, g.token_ids, 1.0)).abs().max().item())
    return {"argmax_same": argmax_same, "greedy_gap": greedy_gap, "sampled_gap": sampled_gap, "greedy": greedy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: rl2.testing.tiny --hidden-size 128)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        model_dir = os.path.join(tempfile.mkdtemp(prefix="rl2-sglang-check-"), "model")
        subprocess.run([sys.executable, "-m", "rl2.testing.tiny", model_dir, "--hidden-size", "128"], check=True,
                       stdout=subprocess.DEVNULL)
    import sglang

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    engine = SGLangEngine(model_dir, tokenizer, dtype="float32")
    started = time.perf_counter() - start
    print(f"SGLang {sglang.__version__}, torch {torch.__version__}: engine start {started:.1f} s", flush=True)
    before = compare(engine, model)

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    moved = max((torch.tensor(g.logprobs) - hf_logprobs(model, p, g.token_ids, 1.0)).abs().max().item()
                for p, g in zip(PROMPTS, before["greedy"]))
    seconds = {}
    for name, call in (("sleep", engine.sleep), ("update_weights", lambda: engine.update_weights(model.state_dict().items())),
                       ("wake", engine.wake)):
        start = time.perf_counter()
        call()
        seconds[name] = time.perf_counter() - start
    after = compare(engine, model)
    engine.shutdown()

    for name, r in (("before the push", before), ("after the push", after)):
        print(f"{name:<16} greedy = HF argmax {r['argmax_same']}/{len(PROMPTS)}, max |engine - HF| log-prob: "
              f"greedy {r['greedy_gap']:.2e}, sampled (T=1) {r['sampled_gap']:.2e}", flush=True)
    print(f"the push: {', '.join(f'{name} {value:.2f} s' for name, value in seconds.items())}; it moved HF's log-probs of the old greedy tokens "
          f"by up to {moved:.2e}", flush=True)
    ok = all(r["greedy_gap"] < args.tolerance and r["sampled_gap"] < args.tolerance for r in (before, after)) \
        and moved > 10 * args.tolerance
    print("OK" if ok else "FAILED", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
