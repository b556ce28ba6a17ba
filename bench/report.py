"""How long `python -m rl2.report` takes and what the browser loads: a 60-step demo-sized run (128 trajectories a
step, in the page) and a 1,000-step run of 1,024 trajectories a step (each dump a side file read when picked),
both synthetic (the trainer's dump format), and the time headless Chromium takes to open each at its last step.

    python bench/report.py [--big-steps 1000] [--big-per-step 1024]
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import tempfile
import time

from rl2.report import write_report


def synthetic_run(folder: str, steps: int, per_step: int) -> int:
    """A run folder with `steps` metric rows and dumps; the dumps' bytes."""
    os.makedirs(os.path.join(folder, "trajectories"))
    rng = random.Random(0)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "reward/mean": rng.random(), "response_length/mean": rng.randint(10, 99),
                                "actor/loss": rng.random(), "actor/entropy": rng.random(), "time/step": rng.random()}) + "\n")
    size = 0
    for step in range(1, steps + 1):
        path = os.path.join(folder, "trajectories", f"step_{step}.jsonl")
        with open(path, "w") as f:
            for i in range(per_step):
                f.write(json.dumps({"group": i // 8, "reward": float(rng.random() < 0.5), "turns": 2, "answer": "7",
                                    "response_length": 40, "truncated": False, "errors": [],
                                    "messages": [{"role": "user", "content": f"What is {i} + {step}?"},
                                                 {"role": "assistant", "content": "<tool_call>lookup</tool_call>"},
                                                 {"role": "tool", "content": str(i + step)},
                                                 {"role": "assistant", "content": f"\\boxed{{{i + step}}}"}]}) + "\n")
        size += os.path.getsize(path)
    return size


def open_in_chromium(page: str, dump: str) -> float:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        return float("nan")
    with tempfile.TemporaryDirectory() as profile:
        start = time.perf_counter()
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                        "--disable-background-networking", "--dump-dom", f"file://{page}#dump={dump}"],
                       capture_output=True, timeout=300)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--big-steps", type=int, default=1000)
    parser.add_argument("--big-per-step", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for name, steps, per_step in (("demo", 60, 128), ("big", args.big_steps, args.big_per_step)):
            run = os.path.join(folder, name)
            dumps = synthetic_run(run, steps, per_step)
            start = time.perf_counter()
            page = write_report([run])
            seconds = time.perf_counter() - start
            side = os.path.join(run, "report_files")
            side_bytes = sum(os.path.getsize(os.path.join(side, f)) for f in os.listdir(side)) if os.path.isdir(side) else 0
            opened = open_in_chromium(page, f"step_{steps}")
            print(f"{name}: {steps} steps x {per_step} trajectories ({dumps / 2**20:.0f} MiB of dumps): report written "
                  f"in {seconds:.2f} s, page {os.path.getsize(page) / 2**20:.1f} MiB, side files {side_bytes / 2**20:.0f} "
                  f"MiB; Chromium opens it at the last step in {opened:.1f} s", flush=True)


if __name__ == "__main__":
    main()
