"""bench/multi_turn_rollout.py runs small: both schedules, the same tokens, a ratio printed."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_multi_turn_bench_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/multi_turn_rollout.py", "--trajectories", "6", "--turns", "3", "--max-new-tokens", "8",
         "--median-new-tokens", "3", "--tool-ms", "5", "--hidden-size", "64", "--layers", "2", "--repeats", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line[:14].strip(): line[14:].split() for line in result.stdout.splitlines()
            if line.startswith(("turn by turn", "one schedule ")) and "/" not in line}
    assert set(rows) == {"turn by turn", "one schedule"}
    assert rows["turn by turn"][0] == rows["one schedule"][0] and int(rows["one schedule"][0]) > 6 * 3
    assert "one schedule / turn by turn: " in result.stdout
