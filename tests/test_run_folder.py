"""One run per checkpoint folder: runs with the default names no longer write over one another's
checkpoints (`rl2.run_folder`, `Trainer.claim_save_dir`)."""

import json
import os

import pytest

from conftest import run_torchrun
from rl2.metrics import read_metrics
from rl2.run_folder import MARKER, check_run_folder, claim_run_folder, describe_run


def write_sft_rows(path, n: int) -> str:
    with open(path, "w") as f:
        for i in range(n):
            row = {"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": f"{i}"}]}
            f.write(json.dumps(row) + "\n")
    return str(path)


def sft_args(model_dir: str, data: str, *extra: str) -> list[str]:
    """A one-step SFT run with the default experiment name and checkpoint folder (ckpts/run)."""
    return [
        "-m", "rl2.trainer.sft", f"data.path={data}", "data.batch_size=4", f"actor.model_name={model_dir}",
        "actor.dtype=float32", "actor.max_length_per_device=96", "actor.gradient_checkpointing=false",
        "trainer.total_steps=1", "trainer.disable_wandb=true", *extra,
    ]


def test_default_named_runs_do_not_overwrite_each_other(tiny_model_dir, tmp_path):
    """Two ranks, in one working directory: the second default-named run stops before any model loads,
    naming the first; it resumes with trainer.load_ckpt_from=latest, starts over with trainer.overwrite=true,
    and another trainer.experiment_name gets a folder of its own."""
    data = write_sft_rows(tmp_path / "rows.jsonl", 8)
    folder = tmp_path / "ckpts" / "run"

    run_torchrun(sft_args(tiny_model_dir, data), cwd=str(tmp_path))
    assert (folder / "step1" / "trainer_state.json").exists()
    marker = json.loads((folder / MARKER).read_text())
    assert marker["command"] == "sft" and marker["experiment_name"] == "run"
    metrics = (folder / "metrics.jsonl").read_text()

    second = run_torchrun(sft_args(tiny_model_dir, data), cwd=str(tmp_path), check=False)
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
    error = second.stderr.strip().splitlines()[-1]
    assert error.startswith("rl2: error: actor.save_dir=ckpts/run holds another run: the sft run 'run' started "
                            f"{marker['started']} (checkpoints step1, metrics.jsonl)"), error
    assert "trainer.load_ckpt_from=latest" in error and "trainer.overwrite=true" in error
    assert "trainer.experiment_name" in error
    assert "training rows" not in second.stderr  # logged once the model is built: it never was
    bad_data = run_torchrun(sft_args(tiny_model_dir, str(tmp_path / "missing.jsonl"), "trainer.experiment_name=bad"),
                            cwd=str(tmp_path), check=False)
    assert bad_data.returncode != 0 and not (tmp_path / "ckpts" / "bad").exists()  # a run that never started: no trace
    assert (folder / "metrics.jsonl").read_text() == metrics and sorted(os.listdir(folder)) == [
        "metrics.jsonl", "report.html", MARKER, "step1"]

    resumed = run_torchrun(sft_args(tiny_model_dir, data, "trainer.total_steps=2", "trainer.load_ckpt_from=latest"),
                           cwd=str(tmp_path))
    assert "resumed from ckpts/run/step1 at step 1" in resumed.stderr
    assert [row["step"] for row in read_metrics(str(folder / "metrics.jsonl"))] == [1, 2]
    assert (folder / "step2").exists() and json.loads((folder / MARKER).read_text()) == marker  # still that run

    fresh = run_torchrun(sft_args(tiny_model_dir, data, "trainer.overwrite=true"), cwd=str(tmp_path))
    assert "trainer.overwrite=true: deleted the sft run 'run'" in fresh.stderr
    assert not (folder / "step2").exists(), "a step folder of the old run is left"
    assert [row["step"] for row in read_metrics(str(folder / "metrics.jsonl"))] == [1]
    assert (folder / "step1" / "trainer_state.json").exists()

    run_torchrun(sft_args(tiny_model_dir, data, "trainer.experiment_name=other"), cwd=str(tmp_path))
    assert (tmp_path / "ckpts" / "other" / "step1" / "trainer_state.json").exists()
    assert [row["step"] for row in read_metrics(str(folder / "metrics.jsonl"))] == [1]


def test_check_and_claim_run_folder(tmp_path):
    folder = str(tmp_path / "ckpts" / "run")
    check = lambda **kw: check_run_folder(folder, "actor.save_dir", **{"resume": False, "overwrite": False, **kw})
    claim = lambda **kw: claim_run_folder(folder, "ppo", "run", **{"resume": False, "overwrite": False, **kw})

    assert check() is None and not os.path.exists(folder)  # checking writes nothing
    claim()  # a new folder: the marker is written
    assert json.loads(open(os.path.join(folder, MARKER)).read())["command"] == "ppo"
    assert describe_run(folder) is None and check() is None  # a marker alone (nothing written yet) blocks nothing

    # An evaluation's outputs (trainer.eval_only) are not a training run's.
    os.makedirs(os.path.join(folder, "trajectories"))
    open(os.path.join(folder, "trajectories", "eval.jsonl"), "w").close()
    open(os.path.join(folder, "eval.json"), "w").close()
    assert describe_run(folder) is None and check() is None

    open(os.path.join(folder, "trajectories", "step_1.jsonl"), "w").close()  # a PPO run that died in step 1
    assert "ppo run 'run'" in check() and "(no checkpoint, trajectories/)" in describe_run(folder)
    os.makedirs(os.path.join(folder, "step10"))
    os.makedirs(os.path.join(folder, "step5"))
    assert "(checkpoints step5, step10, trajectories/)" in check()
    assert check(resume=True) is None and check(overwrite=True) is None  # the ways out
    marker = open(os.path.join(folder, MARKER)).read()
    claim(resume=True)
    assert open(os.path.join(folder, MARKER)).read() == marker  # a resumed run keeps the run's marker

    os.remove(os.path.join(folder, MARKER))  # e.g. a folder written before the marker existed
    assert check().startswith(f"actor.save_dir={folder} holds another run: a run without a run marker (checkpoints")

    claim(overwrite=True)
    assert sorted(os.listdir(folder)) == ["eval.json", MARKER]  # the run's outputs gone, the evaluation's report kept
    assert check() is None


@pytest.mark.parametrize("command", ["sft", "ppo"])
def test_overwrite_and_resume_together_are_refused(command):
    from rl2.config import ConfigError, load_config
    from rl2.config_checks import check_config

    config = load_config(["data.path=rows.jsonl", "actor.model_name=Qwen/Qwen2.5-0.5B-Instruct",
                          "rollout.env_path=envs/demo_successor.py", "trainer.overwrite=true",
                          "trainer.load_ckpt_from=latest"])
    with pytest.raises(ConfigError, match="trainer.overwrite=true starts afresh"):
        check_config(config, command)
