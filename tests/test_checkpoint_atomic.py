"""Checkpoints are never torn: a save cut short (a rank killed while it writes) leaves its step folder
without the completeness marker, a re-save of a step removes the marker first, and
`trainer.load_ckpt_from=latest` takes the last complete step, warning of the ones it skips."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from conftest import REPO, kill_tree, run_torchrun
from rl2.checkpoint import (
    STATE_FILE,
    CheckpointError,
    checkpoint_problem,
    find_latest_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    start_checkpoint,
)
from rl2.metrics import read_metrics
from test_run_folder import write_sft_rows


@pytest.fixture
def warnings_of_checkpoint(caplog) -> pytest.LogCaptureFixture:
    """rl2.checkpoint's records (its parent `rl2` logger may not propagate once a run set up logging)."""
    checkpoint_logger = logging.getLogger("rl2.checkpoint")
    checkpoint_logger.addHandler(caplog.handler)
    checkpoint_logger.propagate = False  # each record once
    yield caplog
    checkpoint_logger.propagate = True
    checkpoint_logger.removeHandler(caplog.handler)


def save_step(save_dir: str, step: int) -> str:
    """A complete one-process checkpoint of a small linear model at `step`, as a trainer's save writes it."""
    path = os.path.join(save_dir, f"step{step}")
    model = nn.Linear(64, 64)
    start_checkpoint(path)
    save_checkpoint(path, {"actor": (model, torch.optim.AdamW(model.parameters()))}, {"step": step})
    return path


def shard(path: str) -> str:
    return os.path.join(path, "dcp", "__0_0.distcp")


def test_an_empty_state_file_is_skipped_with_a_warning(tmp_path, warnings_of_checkpoint):
    save_dir = str(tmp_path)
    step3, step4 = save_step(save_dir, 3), save_step(save_dir, 4)
    assert find_latest_checkpoint(save_dir) == step4 and not warnings_of_checkpoint.records
    open(os.path.join(step4, STATE_FILE), "w").close()  # a kill while the marker was written, before this change
    assert find_latest_checkpoint(save_dir) == step3
    [record] = warnings_of_checkpoint.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith(f"skipping incomplete checkpoints ({step4}: {STATE_FILE} is empty: a save was cut short)")
    assert record.getMessage().endswith(f"the latest complete one is {step3}")
    with pytest.raises(CheckpointError, match=f"load_ckpt_from={step4} is not a complete checkpoint: {STATE_FILE}"):
        resolve_checkpoint(step4, save_dir)


def test_a_torn_resave_beside_a_complete_step_is_skipped(tmp_path, warnings_of_checkpoint):
    """Step 4 saved again and cut short in its shards, its old marker left (as before this change): step 3."""
    save_dir = str(tmp_path)
    step3, step4 = save_step(save_dir, 3), save_step(save_dir, 4)
    size = os.path.getsize(shard(step4))
    with open(shard(step4), "r+b") as f:
        f.truncate(size // 2)
    assert checkpoint_problem(step4) == (f"the shard dcp/__0_0.distcp is {size // 2} of its {size} bytes: "
                                         "a save was cut short")
    assert resolve_checkpoint("latest", save_dir) == step3
    [record] = warnings_of_checkpoint.records
    assert step4 in record.getMessage() and record.getMessage().endswith(f"the latest complete one is {step3}")
    os.remove(shard(step4))
    assert "dcp/__0_0.distcp is missing" in checkpoint_problem(step4)
    with pytest.raises(CheckpointError, match="is not a complete checkpoint: the shard dcp/__0_0.distcp is missing"):
        resolve_checkpoint(step4, save_dir)

    shutil.rmtree(os.path.join(save_dir, "step3"))  # nothing complete left: a fresh start, with the warning
    assert find_latest_checkpoint(save_dir) is None
    assert warnings_of_checkpoint.records[-1].getMessage().endswith(f"no complete one under {save_dir}")


def test_a_resave_removes_the_marker_before_anything_is_written(tmp_path):
    save_dir = str(tmp_path)
    step3, step4 = save_step(save_dir, 3), save_step(save_dir, 4)
    start_checkpoint(step4)  # a re-save of step 4 begins: until its marker is written again, step 3 is the latest
    assert not os.path.exists(os.path.join(step4, STATE_FILE)) and find_latest_checkpoint(save_dir) == step3
    save_step(save_dir, 4)
    assert find_latest_checkpoint(save_dir) == step4 and sorted(os.listdir(step4)) == ["dcp", STATE_FILE]
    assert json.load(open(os.path.join(step4, STATE_FILE))) == {"step": 4}


def test_a_checkpoint_written_before_the_marker_was_atomic_still_resumes(tmp_path):
    """The format is unchanged: a complete older checkpoint (a state file that parses, its shards whole)."""
    step = save_step(str(tmp_path), 2)
    with open(os.path.join(step, STATE_FILE), "w") as f:  # as the old save wrote it, in place
        json.dump({"step": 2, "sampler": {"epoch": 0}}, f, indent=1)
    assert checkpoint_problem(step) is None and resolve_checkpoint("latest", str(tmp_path)) == step


# ---- a real rank killed while it writes its part of a save -------------------------------------------------

def hold_at(path: str) -> int:
    """Make `path` a named pipe that this process holds open and full: a rank that opens it to write its file
    there is stopped in its first write, until it is killed. Returns the pipe's descriptor here."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.mkfifo(path)
    descriptor = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        while True:
            os.write(descriptor, b"\0" * 65536)
    except BlockingIOError:
        return descriptor


def writer_of(path: str) -> int | None:
    """The process, other than this one, that has `path` open, or None."""
    for name in filter(str.isdigit, os.listdir("/proc")):
        if int(name) == os.getpid():
            continue
        try:
            if any(os.readlink(f"/proc/{name}/fd/{fd}") == path for fd in os.listdir(f"/proc/{name}/fd")):
                return int(name)
        except OSError:
            continue
    return None


def torchrun(args: list[str]) -> subprocess.Popen:
    """`args` under the real torchrun, 2 ranks, in a session of its own."""
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kill_the_rank_writing(path: str, args: list[str], timeout: float = 180) -> None:
    """Run `args` until a rank opens `path` to write it, SIGKILL that rank from here (its own process:
    torchrun then stops the other and exits), and leave `path` as the kill leaves it: an empty file (the
    marker's temporary file: none)."""
    descriptor = hold_at(path)
    process = torchrun(args)
    try:
        deadline = time.monotonic() + timeout
        while (writer := writer_of(path)) is None:
            assert process.poll() is None, f"the run ended before a rank wrote {path}:\n{process.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, f"no rank wrote {path} in {timeout} s"
            time.sleep(0.05)
        os.kill(writer, signal.SIGKILL)
        assert process.wait(timeout=60) != 0
    finally:
        kill_tree(process.pid)
        process.wait()
        os.close(descriptor)
    os.remove(path)
    if not path.endswith(".tmp"):
        open(path, "w").close()


def kill_rank1_mid_shard(step_dir: str, args: list[str], timeout: float = 180) -> None:
    """Run `args` (["-m", module, ...]) until rank 1 has written part of its shard in `step_dir/dcp`, where
    it SIGKILLs itself (`workers/killed_mid_shard.py`: dcp's file writes cannot be held from outside, it
    seeks in them); torchrun then stops rank 0 and exits."""
    process = torchrun([os.path.join(REPO, "tests", "workers", "killed_mid_shard.py"), step_dir, "1", *args[1:]])
    try:
        _, stderr = process.communicate(timeout=timeout)
    finally:
        kill_tree(process.pid)
    assert process.returncode != 0 and "exitcode  : -9" in stderr, stderr[-3000:]
    assert 0 < os.path.getsize(os.path.join(step_dir, "dcp", "__1_0.distcp"))


def sft_args(model_dir: str, data: str, save_dir: str, total_steps: int, *extra: str) -> list[str]:
    return [
        "-m", "rl2.trainer.sft", f"data.path={data}", "data.test_ratio=0", "data.batch_size=4",
        f"actor.model_name={model_dir}", "actor.dtype=float32", "actor.max_length_per_device=96",
        "actor.gradient_checkpointing=false", f"actor.save_dir={save_dir}", "actor.save_freq=1",
        f"trainer.total_steps={total_steps}", "trainer.disable_wandb=true", *extra,
    ]


def assert_resumes_from(save_dir: str, args: list[str], step: int, skipped: str, total_steps: int) -> None:
    """`trainer.load_ckpt_from=latest` warns that it skips `skipped`, resumes at `step` and trains to the end."""
    resumed = run_torchrun([*args, "trainer.load_ckpt_from=latest"])
    assert f"skipping incomplete checkpoints ({os.path.join(save_dir, skipped)}: " in resumed.stderr, resumed.stderr[-3000:]
    assert f"resumed from {os.path.join(save_dir, f'step{step}')} at step {step}" in resumed.stderr
    assert [row["step"] for row in read_metrics(os.path.join(save_dir, "metrics.jsonl"))] == list(range(1, total_steps + 1))
    for done in range(1, total_steps + 1):
        assert checkpoint_problem(os.path.join(save_dir, f"step{done}")) is None
    assert not os.path.exists(os.path.join(save_dir, f"step{total_steps}", f"{STATE_FILE}.tmp"))


@pytest.mark.parametrize("point", [
    "tokenizer.json",  # rank 0's Hugging Face folder, after its weights (safetensors writes those atomically)
    "dcp/__1_0.distcp",  # rank 1's shard, part written
    f"{STATE_FILE}.tmp",  # rank 0's marker, once every shard is written
])
def test_a_rank_killed_mid_save_resumes_from_the_last_complete_step(tiny_model_dir, tmp_path, point):
    data = write_sft_rows(tmp_path / "rows.jsonl", 16)
    save_dir = str(tmp_path / "run")
    args = sft_args(tiny_model_dir, data, save_dir, 3)
    step2 = os.path.join(save_dir, "step2")
    if point.startswith("dcp/"):
        kill_rank1_mid_shard(step2, args)
    else:  # held there until killed; the folder exists beforehand, so the run resumes (none yet) rather than refuse it
        kill_the_rank_writing(os.path.join(step2, point), [*args, "trainer.load_ckpt_from=latest"])
    assert checkpoint_problem(os.path.join(save_dir, "step1")) is None
    assert checkpoint_problem(step2) is not None and not os.path.exists(os.path.join(step2, STATE_FILE))
    assert_resumes_from(save_dir, args, step=1, skipped="step2", total_steps=3)


def test_a_rank_killed_while_an_existing_step_is_saved_again(tiny_model_dir, tmp_path):
    """Resumed from step 2 explicitly, the run saves steps 3 and 4 again; rank 1 killed mid-write of its shard
    of step 4, the run resumes from the new step 3, not from step 4's old marker beside a partial shard."""
    data = write_sft_rows(tmp_path / "rows.jsonl", 16)
    save_dir = str(tmp_path / "run")
    args = sft_args(tiny_model_dir, data, save_dir, 4)
    run_torchrun(args)
    step4 = os.path.join(save_dir, "step4")
    kill_rank1_mid_shard(step4, [*args, f"trainer.load_ckpt_from={os.path.join(save_dir, 'step2')}"])
    assert not os.path.exists(os.path.join(step4, STATE_FILE)), "step 4's old marker is left"
    assert checkpoint_problem(os.path.join(save_dir, "step3")) is None
    assert_resumes_from(save_dir, args, step=3, skipped="step4", total_steps=4)
