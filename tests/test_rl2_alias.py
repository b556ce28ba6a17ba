"""RL2's package name (issue 64, item 6): `torchrun -m RL2.trainer.ppo ...`, the module path RL2's scripts use
verbatim, runs rl2's trainer with RL2's keys; `RL2.datasets` / `RL2.utils.communication` are rl2's versions of
RL2 HEAD's helpers, and loading an RL2 HEAD env file still works with the real `RL2` imported. No folder
`RL2/` sits beside `rl2/` (one folder on a case-insensitive filesystem)."""

import importlib
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, run_torchrun
from rl2.compat.rl2_head_api import rl2_modules
from rl2.metrics import read_metrics
from test_rl2_scripts import readme_countdown_port

TRAINERS = ("ppo", "sft", "rm", "dpo")


@pytest.mark.parametrize("name", TRAINERS)
def test_each_rl2_trainer_module_runs_rl2s_trainer(name):
    assert importlib.import_module(f"RL2.trainer.{name}").main is importlib.import_module(f"rl2.trainer.{name}").main


def test_python_m_rl2_trainer_ppo_help():
    env = {**os.environ, "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-m", "RL2.trainer.ppo", "--help"], capture_output=True, text=True,
                            timeout=300, env=env, cwd="/")  # outside the checkout: the installed package
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: torchrun --nproc_per_node=N -m rl2.trainer.ppo")
    assert "train_data.sampling_params.* -> rollout.train_sampling_params.*" in result.stdout  # RL2's keys too


def test_rl2_helper_modules_are_the_ones_env_files_get_while_loading():
    """`RL2.datasets` and `RL2.utils.communication` hold what `rl2_modules()` installs while an env file loads."""
    import RL2.datasets
    import RL2.utils.communication

    def public(module) -> dict:
        return {name: value for name, value in vars(module).items() if not name.startswith("_") and callable(value)}

    shadow = rl2_modules()
    assert public(RL2.datasets) == public(shadow["RL2.datasets"])
    assert public(RL2.utils.communication) == public(shadow["RL2.utils.communication"])


def test_an_rl2_head_env_file_loads_beside_the_real_package(tmp_path):
    """With the real `RL2` imported (as under `-m RL2.trainer.ppo`), an RL2 HEAD env file loads (its imports at
    load time and one inside a function), and the real package is in place afterwards."""
    import RL2.trainer.ppo
    from rl2.compat.rl2_head_api import Sample
    from rl2.rollout.rl2_head_rollout import RL2HeadFile

    path = tmp_path / "head.py"
    path.write_text("from RL2.datasets import Sample, base_generate\n\n"
                    "async def generate(config, tokenizer, router_url, sample):\n"
                    "    from RL2.utils.communication import async_request\n"
                    "    return async_request\n")
    env_file = RL2HeadFile(str(path))
    assert env_file.module.Sample is Sample
    assert sys.modules["RL2.trainer.ppo"] is RL2.trainer.ppo and sys.modules["RL2"].trainer is RL2.trainer
    import asyncio

    from rl2.compat.rl2_head_api import async_request

    assert asyncio.run(env_file.module.generate(None, None, "", None)) is async_request


def test_no_rl2_folder_beside_rl2():
    """Paths that differ only in case are one path on macOS and Windows: a clone would lose files."""
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO, check=True).stdout.split()
    folded: dict[str, str] = {}
    for path in files:
        for end in range(1, len(parts := path.split("/")) + 1):
            prefix = "/".join(parts[:end])
            assert folded.setdefault(prefix.lower(), prefix) == prefix, (prefix, folded[prefix.lower()])
    assert not os.path.exists(os.path.join(REPO, "RL2"))


def test_torchrun_m_rl2_trainer_ppo_trains_with_rl2s_nov_dec_keys(tiny_model_dir, tmp_path):
    """RL2's countdown_reinforce.sh of Nov-Dec 2025 (1fce214), with local files and a tiny model, launched as it
    is written: `torchrun -m RL2.trainer.ppo train_data.* ...`."""
    rows = [{"prompt": f"Using {[i, i + 1]}, make {2 * i + 1}. Answer: <answer>",
             "answer": {"numbers": [i, i + 1], "target": 2 * i + 1}} for i in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "countdown.py").write_text(readme_countdown_port())
    save_dir = tmp_path / "ckpts" / "qwen2.5-3b_reinforce"
    result = run_torchrun([
        "-m", "RL2.trainer.ppo",
        f"train_data.path={tmp_path / 'train.jsonl'}", "train_data.prompts_per_rollout=2",
        "train_data.responses_per_prompt=2", "train_data.sampling_params.max_new_tokens=6",
        "train_data.sampling_params.stop=['</answer>']", "train_data.apply_chat_template=false",
        "test_data.prompts_per_rollout=2", f"actor.model_name={tiny_model_dir}", "actor.max_length_per_device=512",
        f"rollout.env_path={tmp_path / 'countdown.py'}", "trainer.project=Countdown",
        "trainer.experiment_name=qwen2.5-3b_reinforce", "trainer.total_steps=1", "trainer.use_wandb=false",
        # this machine's: a CPU run in float32, no test split
        "actor.dtype=float32", f"trainer.save_dir={save_dir}", "rollout.test_ratio=0",
    ], nproc=1)
    [metrics] = read_metrics(str(save_dir / "metrics.jsonl"))
    assert metrics["step"] == 1 and metrics["reward_errors"] == 0 and (save_dir / "step1").is_dir()
    assert "RL2's train_data.apply_chat_template is rl2's data.apply_chat_template" in result.stderr
    [trajectory, _] = [json.loads(line) for line in open(save_dir / "trajectories" / "step_1.jsonl")][:2]
    assert trajectory["messages"][0]["content"].startswith("Using")  # the raw prompt, as RL2 read it
