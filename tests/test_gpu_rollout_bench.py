"""bench/gpu_rollout.py (written for an H100) runs on CPU with the tiny shape: every case, both
methods, the same token counts, every row printed."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_rollout_bench_runs_on_cpu(tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/gpu_rollout.py", "--shape", "tiny", "--batches", "16", "--new-tokens", "8",
         "--min-prompt", "8", "--max-prompt", "40"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["distinct"], ["shared"],
                                                                                          ["multi-turn"])]
    assert [(row[0], " ".join(row[2:-5])) for row in rows] == [
        (case, method) for case in ("distinct", "shared", "multi-turn")
        for method in ("hf engine (+capture)", "hf engine", "model.generate")
    ]
    for row in rows:
        assert int(row[1]) == 16 and float(row[-4]) > 0 and row[-2].endswith("x")
        assert int(row[-4]) == (16 * 8 * 3 if row[0] == "multi-turn" else 16 * 8)  # tokens
