"""The agents guide's first run (docs/guides/agents.md, `<!-- test: agent -->`) runs as written: in a folder holding
the repository files its command names (the agent file and its rows), the tiny model is made and the agent trains
through rl2's OpenAI-compatible server, 2 steps, every request served (no 400 for tools the template would drop)."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, run_torchrun
from docs_blocks import assert_metrics_documented, blocks_marked, command_lines
from rl2.metrics import read_metrics


def agent_commands() -> list[list[str]]:
    """The words of each command of the block marked `<!-- test: agent -->` (there is one)."""
    [block] = blocks_marked("test", "agent")
    return [line.command for line in command_lines([block])]


def test_the_agent_example_runs_as_written(tmp_path):
    pytest.importorskip("openai", reason="agents need the agents extra: pip install -e '.[agents]'")
    commands = agent_commands()
    assert [words[0] for words in commands] == ["pip", "python", "torchrun"]
    torchrun = commands[-1]
    named = [value for word in torchrun if "=" in word for value in [word.split("=", 1)[1]]
             if os.path.isfile(os.path.join(REPO, value))]
    assert {"envs/calculator_agent.py", "recipes/data/calculator.jsonl"} <= set(named), named
    for path in named:  # the repository's files, where the command names them
        os.makedirs(tmp_path / os.path.dirname(path), exist_ok=True)
        shutil.copy(os.path.join(REPO, path), tmp_path / path)
    env = {**os.environ, "PYTHONPATH": REPO}
    made = subprocess.run([sys.executable, *commands[1][1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    args = torchrun[torchrun.index("-m"):] + ["trainer.total_steps=2", "trainer.test_freq=null"]
    run_torchrun(args, nproc=2, timeout=600, cwd=str(tmp_path))
    rows = read_metrics(str(tmp_path / "ckpts" / "calculator_agent" / "metrics.jsonl"))
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["env_errors"] == 0 and row["trajectories"] == 32, row  # every request served, every run scored
        assert 1 <= row["agent/requests"] <= 2 and row["agent/rendered_tokens"] > 0
    assert os.path.isfile(tmp_path / "ckpts" / "calculator_agent" / "trajectories" / "step_2.jsonl")
    assert_metrics_documented(rows)
