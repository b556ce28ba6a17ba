"""bench/gpu_train.py (written for an H100) runs on CPU with the tiny shape: both methods train,
every row of its table is printed and no measurement is skipped."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_train_bench_runs_on_cpu(tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/gpu_train.py", "--shapes", "tiny", "--tokens", "3000", "--max-tokens", "1024",
         "--steps", "1", "--logps-chunk-size", "300"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "device: CPU"
    rows = [line.split() for line in lines if line.startswith("tiny ")]
    ratios = [row for row in rows if row[3] == "/"]
    measured = [row for row in rows if row[3] != "/"]
    assert [(row[1], row[2]) for row in measured] == [("off", "plain"), ("off", "rl2"), ("on", "plain"), ("on", "rl2")]
    for row in measured:
        assert float(row[3]) > 0 and float(row[6]) > 0  # tokens/s, step seconds
    assert all(row[7].endswith("x") for row in measured if row[2] == "rl2")  # Policy.compute / step
    assert len(ratios) == 2 and all(row[-1].endswith("x") for row in ratios)
    assert "out of memory" not in result.stdout
