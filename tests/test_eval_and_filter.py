"""`trainer.eval_only` (avg@k / pass@k of a model on a test file) and the difficulty filter
(`rl2.trainer.difficulty_filter`), against an env whose pass rates are known exactly."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, run_python, run_torchrun
from rl2 import PPOTrainer
from rl2.config import ConfigError, load_config
from rl2.trainer.difficulty_filter import DifficultyFilter
from rl2.trainer.ppo_eval import PPOEvaluator

# Each row's answer says how its responses score: "always" 1.0, "never" 0.0, "half" 1.0 for every
# other response of that row (a per-row counter, so the share is exact whatever the order; the counter
# is state shared by all calls, so the env runs in threads: rollout.env_workers=0).
ENV = """
import itertools
import threading

_counters = {}
_lock = threading.Lock()


def reward_fn(messages, answer):
    kind = answer.split("-")[0]
    if kind == "half":
        with _lock:
            count = next(_counters.setdefault(answer, itertools.count()))
        return float(count % 2 == 0)
    return 1.0 if kind == "always" else 0.0
"""
ANSWERS = ["always-1", "never-2", "half-3", "always-4", "half-5", "never-6"]


@pytest.fixture()
def problems(tmp_path):
    env = tmp_path / "env.py"
    env.write_text(ENV)
    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as f:
        for i, answer in enumerate(ANSWERS):
            row = {"messages": [{"role": "user", "content": f"Problem {i + 1}: what is {i} + {i}?"}],
                   "answer": answer, "source": f"set-{i % 2}", "id": i + 1}
            f.write(json.dumps(row) + "\n")
    return str(env), str(rows)


def common(model: str, env: str) -> list[str]:
    """The keys both the evaluation (rl2.trainer.ppo) and the difficulty filter read."""
    return [
        f"actor.model_name={model}", "actor.dtype=float32", f"rollout.env_path={env}",
        "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 4}",
        "rollout.test_sampling_params={temperature: 1.0, max_new_tokens: 4}",
        "data.prompts_per_rollout=4", "rollout.env_workers=0",
    ]


def test_eval_only_reports_avg_and_pass_at_k(tiny_model_dir, problems, tmp_path):
    """Into a folder that holds a training run (evaluating its checkpoint there is not another run)."""
    env, rows = problems
    out = tmp_path / "eval"
    (out / "step2").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    result = run_python(["-m", "rl2.trainer.ppo", *common(tiny_model_dir, env), "trainer.eval_only=true",
                         f"data.test_path={rows}", "rollout.test_responses_per_prompt=4", f"actor.save_dir={out}"])
    report = json.loads((out / "eval.json").read_text())
    assert report["prompts"] == 6 and report["k"] == 4 and report["model"] == tiny_model_dir
    assert report["test/avg@4"] == pytest.approx((1 + 0 + 0.5 + 1 + 0.5 + 0) / 6)
    assert report["test/pass@4"] == pytest.approx(4 / 6)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == report
    # no checkpoint, no training, the run's files untouched
    assert sorted(p.name for p in out.iterdir()) == ["eval.json", "metrics.jsonl", "step2", "trajectories"]
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n' and not any((out / "step2").iterdir())
    assert len((out / "trajectories" / "eval.jsonl").read_text().splitlines()) == 24


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.load_ckpt_from=latest"], "pass actor.model_name=<checkpoint folder>"),
        (["data.test_path=null"], "data.test_path is required"),
        (["rollout.test_responses_per_prompt=0"], "rollout.test_responses_per_prompt must be >= 1"),
    ],
)
def test_eval_only_config_errors(tiny_model_dir, problems, tmp_path, overrides, message):
    """Raised before the process group or any model loads (in this process), by the evaluator and by a
    PPOTrainer given the same config."""
    env, rows = problems
    for command in (PPOEvaluator, PPOTrainer):
        with pytest.raises(ConfigError) as error:
            command(load_config([*common(tiny_model_dir, env), "trainer.eval_only=true", f"data.test_path={rows}",
                                 f"actor.save_dir={tmp_path / 'eval'}", *overrides]))
        assert message in str(error.value)
    assert not (tmp_path / "eval").exists()


def test_a_ppo_trainer_given_eval_only_names_the_evaluator(tiny_model_dir, problems, tmp_path):
    env, rows = problems
    with pytest.raises(ConfigError, match=r"PPOEvaluator\(config\)\.train\(\) runs it"):
        PPOTrainer(load_config([*common(tiny_model_dir, env), "trainer.eval_only=true", f"data.test_path={rows}",
                                f"actor.save_dir={tmp_path / 'eval'}"]))


def test_eval_only_config_error_on_the_command_line_is_one_line(tiny_model_dir, problems, tmp_path):
    env, rows = problems
    result = subprocess.run(
        [sys.executable, "-m", "rl2.trainer.ppo", *common(tiny_model_dir, env), "trainer.eval_only=true",
         f"data.test_path={rows}", f"actor.save_dir={tmp_path}", "trainer.load_ckpt_from=latest"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("rl2: error: trainer.eval_only evaluates actor.model_name")


def test_difficulty_filter_keeps_rows_below_the_pass_rate(tiny_model_dir, problems, tmp_path):
    """Two ranks, prompts in chunks of 4 split over them: pass rates land on the right rows, and
    the kept rows are written as read, every column and in order."""
    env, rows = problems
    output = tmp_path / "hard" / "kept.jsonl"
    result = run_torchrun(["-m", "rl2.trainer.difficulty_filter", *common(tiny_model_dir, env), f"data.path={rows}",
                           "filter.responses_per_prompt=4", f"filter.output={output}"])
    originals = [json.loads(line) for line in open(rows)]
    kept = [json.loads(line) for line in open(output)]
    assert kept == [row for row in originals if not row["answer"].startswith("always")]
    rates = [json.loads(line) for line in open(f"{output}.pass_rates.jsonl")]
    assert [r["pass_rate"] for r in rates] == [1.0, 0.0, 0.5, 1.0, 0.5, 0.0]
    assert [r["row"] for r in rates] == [1, 2, 3, 4, 5, 6]
    assert [r["kept"] for r in rates] == [False, True, True, False, True, True]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary == {"problems": 6.0, "kept": 4.0, "always_solved": 2.0, "never_solved": 2.0, "unscored": 0.0, "pass_rate_mean": 0.5}

    # A band: the ones sometimes solved.
    band = tmp_path / "band.jsonl"
    run_python(["-m", "rl2.trainer.difficulty_filter", *common(tiny_model_dir, env), f"data.path={rows}",
                "filter.responses_per_prompt=4", "filter.pass_rate_min=0.1", "filter.pass_rate_below=0.9",
                f"filter.output={band}"])
    assert [json.loads(line)["answer"] for line in open(band)] == ["half-3", "half-5"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["filter.output=null"], "filter.output is required"),
        (["filter.pass_rate_min=0.5", "filter.pass_rate_below=0.5"], "filter.pass_rate_min < filter.pass_rate_below"),
        (["filter.responses_per_prompt=0"], "filter.responses_per_prompt must be >= 1"),
    ],
)
def test_difficulty_filter_config_errors(tiny_model_dir, problems, tmp_path, overrides, message):
    """Raised before the process group or any model loads (in this process)."""
    env, rows = problems
    with pytest.raises(ConfigError) as error:
        DifficultyFilter(load_config([*common(tiny_model_dir, env), f"data.path={rows}",
                                      f"filter.output={tmp_path / 'out.jsonl'}", *overrides]))
    assert message in str(error.value)
    assert not (tmp_path / "out.jsonl").exists()


def test_difficulty_filter_config_error_on_the_command_line_is_one_line(tiny_model_dir, problems, tmp_path):
    env, rows = problems
    result = subprocess.run(
        [sys.executable, "-m", "rl2.trainer.difficulty_filter", *common(tiny_model_dir, env), f"data.path={rows}",
         f"filter.output={tmp_path / 'out.jsonl'}", "filter.responses_per_prompt=0"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "rl2: error: filter.responses_per_prompt must be >= 1" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()
