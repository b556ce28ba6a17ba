"""`python -m rl2.trainer.<command> --check key=value ...` (issue 64, item 11): the keys, the files, the data's first
rows and the models' names checked without loading a model; what was checked on stdout and exit 0, or one
`rl2: error:` line and exit 2."""

import json
import os
import subprocess
import sys

import pytest
import transformers

from conftest import REPO
from rl2.config import ConfigError
from rl2.check_run import run_check
from rl2.data.rows import DataError
from rl2.rollout.env_file import EnvError

REWARD = "def reward_fn(messages, answer):\n    return float(answer in messages[-1]['content'])\n"


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture
def ppo_args(tmp_path, tiny_model_dir) -> list[str]:
    data = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"{i} + 1?", "answer": str(i + 1)} for i in range(150)])
    (tmp_path / "env.py").write_text(REWARD)
    return ["--check", f"data.path={data}", "data.prompt_key=question", f"actor.model_name={tiny_model_dir}",
            f"rollout.env_path={tmp_path / 'env.py'}"]


def check(args: list[str], command: str = "ppo") -> list[str]:
    lines: list[str] = []
    run_check(args, command, say=lines.append)
    return lines


def test_a_good_run_is_checked_without_loading_a_model(ppo_args, tiny_model_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("--check loaded a model or tokenizer")

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(auto, "from_pretrained", refuse)
    lines = check(ppo_args)
    data, env = ppo_args[1].partition("=")[2], ppo_args[4].partition("=")[2]
    assert lines == [
        "rl2: check: the keys parse and fit together for rl2.trainer.ppo",
        f"rl2: check: data.path={data}: 150 rows, columns ['question', 'answer']; the first 100 are valid rl rows",
        f"rl2: check: rollout.env_path={env}: loads, defines reward_fn",
        f"rl2: check: actor.model_name={tiny_model_dir}: Qwen2ForCausalLM, a local folder",
        "rl2: check: ok (no model was loaded)",
    ]


def test_each_kind_of_mistake_is_the_error_a_run_would_meet(ppo_args, tmp_path):
    with pytest.raises(ConfigError, match="did you mean data.prompts_per_rollout"):
        check([*ppo_args, "data.prompt_per_rollout=4"])
    with pytest.raises(ConfigError, match="rollout.max_turns must be >= 1"):
        check([*ppo_args, "rollout.max_turns=0"])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "fine", "answer": "1"}, {"question": "", "answer": "2"}])
    with pytest.raises(DataError, match=r"bad\.jsonl, row 2, field 'question': the prompt text is empty"):
        check([*ppo_args, f"data.path={bad}"])
    (tmp_path / "no_reward.py").write_text("def score(messages, answer):\n    return 0.0\n")
    with pytest.raises(EnvError, match=r"does not define reward_fn\(messages, answer\)"):
        check([*ppo_args, f"rollout.env_path={tmp_path / 'no_reward.py'}"])
    with pytest.raises(ConfigError, match=r"actor.model_name=.*: no such model folder"):
        check([*ppo_args, f"actor.model_name={tmp_path / 'missing' / 'model'}"])
    (tmp_path / "not_a_model").mkdir()
    with pytest.raises(ConfigError, match=r"actor.model_name=.*not_a_model: a local folder without a model config"):
        check([*ppo_args, f"actor.model_name={tmp_path / 'not_a_model'}"])


def test_sft_and_dpo_rows_and_the_test_set(tmp_path, tiny_model_dir):
    user, assistant = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [user, assistant]}] * 3)
    test = write_jsonl(tmp_path / "test.jsonl", [{"messages": [user]}])  # no assistant turn: not SFT rows
    with pytest.raises(DataError, match=r"test\.jsonl, row 1, field 'messages': SFT rows need at least one assistant"):
        check([f"data.path={sft}", f"data.test_path={test}", f"actor.model_name={tiny_model_dir}"], "sft")
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Capital of France?", "chosen": "Paris", "rejected": "Lyon"}])
    lines = check([f"data.path={pairs}", f"actor.model_name={tiny_model_dir}"], "dpo")
    assert f"rl2: check: data.path={pairs}: 1 rows, columns ['prompt', 'chosen', 'rejected']; the first 1 are valid " \
           "pair rows" in lines


def test_an_rl2_head_env_file_and_rows_without_a_prompt(tmp_path, tiny_model_dir):
    from test_row_shapes import RL2_HEAD_FILE

    (tmp_path / "gem_style.py").write_text(RL2_HEAD_FILE)
    data = write_jsonl(tmp_path / "empty.jsonl", [{"level": 1}] * 2)
    lines = check([f"data.path={data}", f"actor.model_name={tiny_model_dir}", f"rollout.env_path={tmp_path / 'gem_style.py'}"])
    assert any("loads, written to RL2 HEAD's interface" in line for line in lines)
    assert any("the first 2 are valid rl rows" in line for line in lines)


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO, **env})


def test_the_command_line(ppo_args):
    """Exit 0 with what was checked; a Hub name that cannot be fetched offline is one `rl2: error:` line, exit 2."""
    ok = run(["-m", "rl2.trainer.ppo", *ppo_args])
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "rl2: check: ok (no model was loaded)"
    hub_name = [arg if not arg.startswith("actor.model_name=") else "actor.model_name=no-such-org/no-such-model-64"
                for arg in ppo_args]
    missing = run(["-m", "rl2.trainer.ppo", *hub_name], HF_HUB_OFFLINE="1")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    lines = missing.stderr.strip().splitlines()
    assert len(lines) == 1, missing.stderr
    line = lines[0]
    assert line.startswith("rl2: error: actor.model_name=no-such-org/no-such-model-64: not a local folder, and not "
                           "fetched from the Hub: ")
