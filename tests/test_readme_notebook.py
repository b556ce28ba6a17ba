"""The notebook cell of the docs (Getting started, "In a notebook": in one process) runs as written in an empty
folder: it makes its model and data, trains SFT with `train()` and steps PPO by hand with `step_once()` in a `with`
block; both runs log every step once, under its number, with metrics the metrics page documents."""

import os
import subprocess
import sys

from conftest import REPO
from docs_blocks import assert_metrics_documented, blocks_marked
from rl2.metrics import read_metrics


def readme_notebook_lines() -> str:
    """The block marked `<!-- test: notebook -->` (there is one)."""
    [block] = blocks_marked("test", "notebook")
    return block.text


def test_the_readme_notebook_lines_run_as_written(tmp_path):
    code = readme_notebook_lines()
    assert "SFTTrainer(" in code and "PPOTrainer(" in code and ".step_once()" in code
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    # after the cell: a closed run trains no more, and closing it again does nothing
    after = ("\ntry:\n    trainer.step_once()\nexcept RuntimeError as error:\n    print('after close:', error)\n"
             "trainer.close()\n")
    result = subprocess.run([sys.executable, "-c", code + after], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    sft = read_metrics(str(tmp_path / "ckpts" / "my_sft" / "metrics.jsonl"))
    ppo_dir = tmp_path / "ckpts" / "my_ppo"
    ppo = read_metrics(str(ppo_dir / "metrics.jsonl"))
    assert [row["step"] for row in sft if "loss" in row] == [1, 2, 3, 4]  # 39 training rows, batches of 8
    # By hand: each step logged once under its number, its trajectories under it, the test set at the last
    assert [row["step"] for row in ppo if "reward/mean" in row] == [1, 2, 3, 4]  # 39 prompts, 8 a step
    assert [row["step"] for row in ppo if "test/reward_mean" in row] == [4]
    assert sorted(os.listdir(ppo_dir / "trajectories")) == [f"step_{n}.jsonl" for n in (1, 2, 3, 4)] + [
        "test_step_4.jsonl"]
    assert [line for line in result.stdout.splitlines() if line.startswith("step ")] == [
        f"step {row['step']}: reward {row['reward/mean']:.3f}" for row in ppo if "reward/mean" in row]
    assert "after close: this trainer's run is closed" in result.stdout
    # close(): the report written, the last step's checkpoint saved, the summary logged
    assert (ppo_dir / "report.html").is_file() and (ppo_dir / "step4").is_dir()
    assert "no step updated the policy" in result.stderr or "mean step time" in result.stderr
    assert_metrics_documented(sft + ppo)
