"""bench/gpu_checks.py, the first thing to run on a lent GPU: it runs on CPU, and its check of the
variable-length kernel with keys longer than queries tells a kernel aligned to the end of the keys
(what the engine's prefill needs) from one aligned to their start."""

import functools
import importlib.util
import os
import subprocess
import sys

import torch

from conftest import varlen_by_flash_semantics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_gpu_checks():
    sys.path.insert(0, os.path.join(REPO, "bench"))
    spec = importlib.util.spec_from_file_location("gpu_checks", os.path.join(REPO, "bench", "gpu_checks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_checks_run_on_cpu(tmp_path):
    result = subprocess.run([sys.executable, "bench/gpu_checks.py"], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(lines) == 6 and all(line.startswith("PASS") for line in lines), result.stdout
    assert "6 of 6 checks passed" in result.stdout


def test_varlen_check_tells_the_mask_alignment(monkeypatch):
    gpu_checks = load_gpu_checks()
    cpu = torch.device("cpu")
    monkeypatch.setattr("rl2.kernels.attention.torch_varlen_kernel", lambda: varlen_by_flash_semantics)
    assert gpu_checks.check_varlen(cpu, torch.float32, keys_longer=False) < 1e-5
    assert gpu_checks.check_varlen(cpu, torch.float32, keys_longer=True) < 1e-5
    aligned_to_start = functools.partial(varlen_by_flash_semantics, aligned_to_end=False)
    monkeypatch.setattr("rl2.kernels.attention.torch_varlen_kernel", lambda: aligned_to_start)
    assert gpu_checks.check_varlen(cpu, torch.float32, keys_longer=False) < 1e-5  # equal lengths: the same mask
    assert gpu_checks.check_varlen(cpu, torch.float32, keys_longer=True) > 0.1
