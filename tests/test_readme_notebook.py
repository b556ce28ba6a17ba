"""The notebook lines of the docs (Getting started, "In a notebook": in one process) run as written, in a folder
holding what they name: a tiny model `my_model`, `train.jsonl`, `rl.jsonl` and `env.py`; every metric the two runs
log is on the metrics page."""

import json
import os
import subprocess
import sys

from conftest import REPO
from docs_blocks import assert_metrics_documented, blocks_marked
from rl2.metrics import read_metrics
from rl2.testing.tiny import save_tiny


def readme_notebook_lines() -> str:
    """The block marked `<!-- test: notebook -->` (there is one)."""
    [block] = blocks_marked("test", "notebook")
    return block.text


def test_the_readme_notebook_lines_run_as_written(tmp_path):
    save_tiny(str(tmp_path / "my_model"))
    with open(tmp_path / "train.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                                             {"role": "assistant", "content": str(2 * i)}]}) + "\n")
    with open(tmp_path / "rl.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"what is {i} + {i}?"}], "answer": str(2 * i)}) + "\n")
    (tmp_path / "env.py").write_text("def reward_fn(messages, answer):\n    return float(answer in messages[-1]['content'])\n")
    code = readme_notebook_lines()
    assert "SFTTrainer(" in code and "PPOTrainer(" in code
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    sft = read_metrics(str(tmp_path / "ckpts" / "my_sft" / "metrics.jsonl"))
    ppo = read_metrics(str(tmp_path / "ckpts" / "my_ppo" / "metrics.jsonl"))
    assert [row["step"] for row in sft if "loss" in row] == [1, 2, 3, 4]  # 39 training rows, batches of 8
    assert [row["step"] for row in ppo if "reward/mean" in row] == [1, 2, 3, 4]  # 39 prompts, 8 a step
    assert_metrics_documented(sft + ppo)
