"""SFT end to end: 2 ranks learn a memorisable set, checkpoint, get killed, and resume exactly."""

import glob
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rank_launcher
from conftest import REPO, assert_same_gradients, forked_or_real, kill_tree, run_python, run_torchrun
from rl2.workers.policy import token_logps
from rl2.data.conversations import SFTDataset
from rl2.data.sampler import BatchSampler
from rl2.workers.optim import build_optimizer
from rl2.metrics import read_metrics

TIMING_KEYS = {"step_time", "tokens_per_second"}


def write_rows(path, n: int, seed: int) -> str:
    words = "apple river stone cloud green tiger music paper light ocean".split()
    with open(path, "w") as f:
        for i in range(n):
            word = words[(i * 7 + seed) % len(words)]
            row = {"messages": [{"role": "user", "content": f"Reverse {word} {i}"}, {"role": "assistant", "content": word[::-1]}]}
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_data")
    return write_rows(folder / "train.jsonl", 16, 0), write_rows(folder / "test.jsonl", 4, 3)


def sft_args(model_dir, data, save_dir, total_steps, *extra):
    train, test = data
    return [
        "-m", "rl2.trainer.sft", f"data.path={train}", f"data.test_path={test}", "data.batch_size=8",
        f"actor.model_name={model_dir}", "actor.dtype=float32", "actor.lr=1e-2", "actor.max_length_per_device=96",
        "actor.gradient_checkpointing=false", f"actor.save_dir={save_dir}", f"trainer.total_steps={total_steps}",
        "trainer.test_freq=5", "trainer.disable_wandb=true", *extra,
    ]


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir, sft_data, tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("reference"))
    run_torchrun(sft_args(tiny_model_dir, sft_data, save_dir, 30, "actor.save_freq=5"))
    return save_dir


@pytest.mark.gpu_pins
def test_loss_falls_and_checkpoint_reloads(reference_run, tiny_model_dir, sft_data):
    metrics = read_metrics(os.path.join(reference_run, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert metrics[-1]["loss"] < 0.3 * metrics[0]["loss"]
    tests = [m["test/loss"] for m in metrics if "test/loss" in m]
    assert len(tests) == 6 and tests[-1] < tests[0]
    assert all(m["loss_tokens"] > 0 and m["grad_norm"] > 0 for m in metrics)
    # The logged lr is the one each step used: the full rate first, then cosine decay, never 0.
    lrs = [m["lr"] for m in metrics]
    assert lrs[0] == pytest.approx(1e-2) and all(a > b > 0 for a, b in zip(lrs, lrs[1:]))

    # The final HF folder reloads with the Auto classes and reproduces the logged test loss.
    final = os.path.join(reference_run, "step30")
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    test_set = SFTDataset(sft_data[1], tokenizer, None)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(len(test_set)):
            ids, mask = test_set[i]["input_ids"].unsqueeze(0), test_set[i]["loss_mask"]
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            logps = token_logps(model(input_ids=ids, use_cache=False).logits, ids, positions)[0]
            total -= (logps * mask).sum().item()
            tokens += mask.sum().item()
    # The same weights, one sequence at a time vs packed and sharded: float32 rounding, ~1e-6 relative.
    assert abs(total / tokens - metrics[-1]["test/loss"]) < 1e-4


@pytest.mark.gpu_pins
def test_kill_and_resume_continues_exactly(reference_run, tiny_model_dir, sft_data, tmp_path):
    save_dir = str(tmp_path / "interrupted")
    args = sft_args(tiny_model_dir, sft_data, save_dir, 30, "actor.save_freq=5", "trainer.load_ckpt_from=latest")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled"}
    process = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first_checkpoint = os.path.join(save_dir, "step5", "trainer_state.json")
    deadline = time.time() + 240
    while not os.path.exists(first_checkpoint) and process.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    kill_tree(process.pid)  # torchrun and its ranks, mid-run: a crashed node
    process.wait()
    assert os.path.exists(first_checkpoint)
    assert not os.path.exists(os.path.join(save_dir, "step30", "trainer_state.json")), "run finished before the kill"

    resumed = run_torchrun(args)
    assert "resumed from" in resumed.stderr + resumed.stdout

    reference = read_metrics(os.path.join(reference_run, "metrics.jsonl"))
    metrics = read_metrics(os.path.join(save_dir, "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(1, 31)), "a step was repeated or lost"
    for ours, theirs in zip(metrics, reference):
        assert ours.keys() == theirs.keys()
        for key in ours.keys() - TIMING_KEYS:
            # Exact resume replays the same arithmetic on the same machine, ranks and threads (float32
            # weights and AdamW state restored bit for bit), so the steps agree to the last bit; any
            # drift would grow through 25 AdamW steps far past this.
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (ours["step"], key)


def test_notebook_run_in_one_process_with_wandb_offline(tiny_model_dir, sft_data, tmp_path):
    save_dir = str(tmp_path / "notebook")
    script = f"""
from rl2 import SFTTrainer, load_config
config = load_config(["data.path={sft_data[0]}", "data.batch_size=4", "actor.model_name={tiny_model_dir}",
                      "actor.dtype=float32", "actor.lr=3e-3", "actor.save_dir={save_dir}", "trainer.total_steps=3",
                      "trainer.project=rl2-test"])
SFTTrainer(config).train()
print("done")
"""
    no_account = {"WANDB_MODE": None, "WANDB_API_KEY": None, "HOME": str(tmp_path), "WANDB_SILENT": "true"}
    result = run_python(["-c", script], env=no_account)
    assert "done" in result.stdout
    assert [m["step"] for m in read_metrics(os.path.join(save_dir, "metrics.jsonl"))] == [1, 2, 3]
    assert glob.glob(os.path.join(save_dir, "wandb", "offline-run-*")), "wandb did not log offline"
    assert os.path.exists(os.path.join(save_dir, "step3", "model.safetensors"))


def test_continue_from_exported_model_with_optimizer_dir(reference_run, sft_data, tmp_path):
    """A checkpoint folder is a model (`actor.model_name`) and carries its optimizer (`actor.optimizer_dir`)."""
    step30 = os.path.join(reference_run, "step30")
    save_dir = str(tmp_path / "continued")
    run_torchrun(sft_args(step30, sft_data, save_dir, 2, f"actor.optimizer_dir={step30}"))
    continued = read_metrics(os.path.join(save_dir, "metrics.jsonl"))
    reference = read_metrics(os.path.join(reference_run, "metrics.jsonl"))
    assert continued[0]["loss"] < 0.5 * reference[0]["loss"]  # started from the trained weights

    # Same weights and data without the optimizer state: step 1 agrees, step 2 does not (Adam moments differ).
    fresh_dir = str(tmp_path / "fresh")
    run_torchrun(sft_args(step30, sft_data, fresh_dir, 2))
    fresh = read_metrics(os.path.join(fresh_dir, "metrics.jsonl"))
    assert fresh[0]["loss"] == pytest.approx(continued[0]["loss"], rel=1e-6)  # the same forward: bitwise
    assert abs(fresh[1]["loss"] - continued[1]["loss"]) > 1e-4

    with pytest.raises(AssertionError, match="no dcp/ folder"):
        run_torchrun(sft_args(step30, sft_data, str(tmp_path / "bad"), 2, f"actor.optimizer_dir={tmp_path}"))


def test_command_line_errors_are_one_clear_line(tiny_model_dir, tmp_path):
    bad_key = run_python_raw(["-m", "rl2.trainer.sft", "actor.lrr=1"])
    assert bad_key.returncode == 2 and "Traceback" not in bad_key.stderr
    assert "unknown config key 'actor.lrr'" in bad_key.stderr and "valid keys under 'actor'" in bad_key.stderr

    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                        '{"messages": "not a list"}\n')
    bad_data = run_python_raw(["-m", "rl2.trainer.sft", f"data.path={bad_rows}", f"actor.model_name={tiny_model_dir}",
                               f"actor.save_dir={tmp_path / 'out'}", "trainer.disable_wandb=true"])
    assert bad_data.returncode == 2 and "Traceback" not in bad_data.stderr
    assert "bad.jsonl" in bad_data.stderr and "row 2" in bad_data.stderr and "'messages'" in bad_data.stderr

    from rl2 import SFTTrainer
    from rl2.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="data.path is required"):  # before anything starts: in this process
        SFTTrainer(load_config([f"actor.model_name={tiny_model_dir}"]))

    train = tmp_path / "ok.jsonl"
    train.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    bad_sp = run_python_raw(["-m", "rl2.trainer.sft", f"data.path={train}", f"actor.model_name={tiny_model_dir}",
                             "actor.sp_size=2", "trainer.disable_wandb=true"])
    assert bad_sp.returncode == 2 and "Traceback" not in bad_sp.stderr
    assert "actor.sp_size=2 must divide the number of ranks (1)" in bad_sp.stderr


def test_a_batch_with_nothing_to_train_stops_the_run(tiny_model_dir, sft_data, tmp_path):
    """data.max_length shorter than every prompt: each row is cut before its reply, so no token is in the
    loss. The run stops at its first step with one line naming data.max_length (it used to log loss 0.0)."""
    result = run_python_raw(sft_args(tiny_model_dir, sft_data, str(tmp_path / "out"), 3, "data.max_length=10"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("rl2: error:")]
    assert len(error) == 1 and "SFT step 1: the batch's 8 sequences have no token to train on" in error[0]
    assert "8 of them were cut at data.max_length=10 tokens" in error[0] and "raise data.max_length" in error[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or "loss" not in (tmp_path / "out" / "metrics.jsonl").read_text()


def test_a_longer_resumed_run_continues_on_its_own_schedule(tiny_model_dir, sft_data, tmp_path):
    """A 2-step run resumed with total_steps=4: step 3 trains at the 4-step schedule's rate for step 3
    (it used to train at 0.0, the 2-step schedule's end, restored with the optimizer)."""
    save_dir = str(tmp_path / "run")
    run_python(sft_args(tiny_model_dir, sft_data, save_dir, 2, "trainer.test_freq=null"))
    run_python(sft_args(tiny_model_dir, sft_data, save_dir, 4, "trainer.test_freq=null", "trainer.load_ckpt_from=latest"))
    rates = {row["step"]: row["lr"] for row in read_metrics(os.path.join(save_dir, "metrics.jsonl"))}
    optimizer, scheduler = build_optimizer(torch.nn.Linear(1, 1), 1e-2, 0.0, total_steps=4, warmup_ratio=0.03)
    expected = []
    for _ in range(4):
        expected.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[1] == pytest.approx(1e-2) and rates[2] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert [rates[3], rates[4]] == pytest.approx(expected[2:]) and rates[3] > 0


def test_rows_left_over_each_epoch_are_reported():
    assert BatchSampler(64, 32).left_over_note() == ""
    assert BatchSampler(61, 32).left_over_note() == (
        "; 29 rows an epoch do not fill a batch and are left out (other rows each epoch: the order is reshuffled)")
    assert "the last rows of the file" in BatchSampler(61, 32, shuffle=False).left_over_note()


def run_python_raw(args):
    """`python ARGS` as one process (forked from preloaded modules, see `rank_launcher`), whatever
    its exit status. tests/test_eval_and_filter.py's command-line errors run a real interpreter."""
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return forked_or_real(
        lambda: rank_launcher.launch(args, 1, env, REPO, timeout=120, distributed=False),
        lambda: subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=120),
    )


def test_sequence_parallel_gives_the_same_curve(tiny_model_dir, sft_data, tmp_path):
    """actor.sp_size=2 on 2 ranks (each row split over both ranks with ZigZag ring attention)
    follows the sp_size=1 loss curve on 2 ranks; max_length_per_device is per device, so half the
    budget holds the same rows. The model steps with plain SGD (the worker's --sgd): AdamW turns
    rounding in a near-zero gradient into a step of up to lr, so its curves drift apart by amounts
    that depend on the processor; SGD moves each weight by lr times its gradient, so rounding stays
    rounding. (No clipping: the gradients compared are the ones computed.)"""
    runs, saved = {}, {}
    for sp_size, budget in ((1, 96), (2, 48)):
        save_dir = str(tmp_path / f"sp{sp_size}")
        args = sft_args(tiny_model_dir, sft_data, save_dir, 10, "actor.lr=0.1", "actor.max_grad_norm=1e9",
                        f"actor.sp_size={sp_size}", f"actor.max_length_per_device={budget}")[2:]
        result = run_torchrun(["tests/workers/offline_step.py", "sft", f"{save_dir}/step.pt", "--sgd", *args])
        if sp_size == 2:  # the ring's kernel is said once, by rank 0
            assert (result.stdout + result.stderr).count("ring attention with fused pieces") == 1
        runs[sp_size] = read_metrics(os.path.join(save_dir, "metrics.jsonl"))
        saved[sp_size] = torch.load(f"{save_dir}/step.pt")
    assert [m["step"] for m in runs[2]] == list(range(1, 11))
    assert runs[1][-1]["loss"] < runs[1][0]["loss"] - 0.5  # the curve moves
    assert len(saved[1]["steps"]) == len(saved[2]["steps"]) == 10
    for ours, theirs in zip(saved[2]["steps"], saved[1]["steps"]):
        assert_same_gradients(ours["grads"], theirs["grads"])
    for ours, theirs in zip(runs[2], runs[1]):
        for key in ("loss", "loss_tokens", "grad_norm", "test/loss"):
            if key in theirs:
                # float32 rounding of sums in another order (~1e-6 relative; grad_norm sums ~1e5
                # squares), carried along the curve by SGD without amplification.
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4), (ours["step"], key)


def test_tensorboard_holds_the_metrics_of_metrics_jsonl(tiny_model_dir, sft_data, tmp_path):
    """trainer.tensorboard=true: the event files hold every scalar of metrics.jsonl, under the same names and
    steps (read back with tensorboard's own reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    save_dir = str(tmp_path / "run")
    run_python(sft_args(tiny_model_dir, sft_data, save_dir, 4, "trainer.tensorboard=true", "trainer.test_freq=2"))
    assert os.path.getsize(os.path.join(save_dir, "report.html")) > 0  # every run ends by writing its report
    events = EventAccumulator(os.path.join(save_dir, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    rows = read_metrics(os.path.join(save_dir, "metrics.jsonl"))
    expected = {(name, row["step"]): value for row in rows for name, value in row.items() if name != "step"}
    got = {(name, event.step): event.value for name in events.Tags()["scalars"] for event in events.Scalars(name)}
    assert got.keys() == expected.keys() and len(got) > 20
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-6), key  # stored as float32
