"""The reward-model and DPO trainers: a step on 1 rank equals the same step on 2 ranks, both learn a
small preference set (held-out accuracy), checkpoints reload (the reward model scores text, also
through an env file), resume is exact, they run in a notebook, and bad configs stop them early."""

import math
import os
import shutil

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from conftest import assert_same_gradients, run_python, run_torchrun
from docs_blocks import assert_metrics_documented
from rl2.workers.policy import token_logps
from rl2.config import ConfigError, load_config
from rl2.data.conversations import PairDataset
from rl2.data.rows import load_rows
from rl2.rollout.env import Env, EnvError
from rl2.metrics import read_metrics
from rl2.algorithms.preference import pair_sequences
from rl2.rollout.reward_scorer import RewardScorer

TIMING_KEYS = {"step_time", "tokens_per_second", "time/reference"}
SECTION = {"rm": "critic", "dpo": "actor"}


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("pairs"))
    run_python(["recipes/make_pair_data.py", out, "--rows", "96", "--test-rows", "32"])
    return out


def pair_args(trainer: str, model_dir: str, data: str, save_dir: str, steps: int, *extra: str) -> list[str]:
    section = SECTION[trainer]
    return [
        "-m", f"rl2.trainer.{trainer}", f"data.path={data}/train.jsonl", f"data.test_path={data}/test.jsonl",
        "data.batch_size=16", f"{section}.model_name={model_dir}", f"{section}.dtype=float32",
        f"{section}.gradient_checkpointing=false", f"{section}.lr=1e-3", f"{section}.max_length_per_device=160",
        f"{section}.save_dir={save_dir}", f"trainer.total_steps={steps}", "trainer.test_freq=6",
        "trainer.disable_wandb=true", *extra,
    ]


# ---- world-size invariance ------------------------------------------------------------------


STEP_WORKER = "tests/workers/offline_step.py"


@pytest.fixture(scope="module")
def one_rank_step(tiny_model_dir, pair_data, tmp_path_factory):
    """One step on one process, per trainer: its save folder and what the worker saved."""
    results = {}

    def result(trainer: str) -> tuple[str, dict]:
        if trainer not in results:
            save_dir = str(tmp_path_factory.mktemp(f"{trainer}_one"))
            run_python(step_worker_args(trainer, tiny_model_dir, pair_data, save_dir))
            results[trainer] = save_dir, torch.load(f"{save_dir}/step.pt")
        return results[trainer]

    return result


def step_worker_args(trainer: str, model_dir: str, data: str, save_dir: str, *extra: str) -> list[str]:
    """One step of `trainer` through the worker that saves the gradients it stepped with."""
    section = SECTION[trainer]
    # A budget of 100 tokens holds one pair (about 70 tokens): 16 micro-batches on one rank, 8 on each of two.
    dpo = ["actor.beta=0.5", "actor.label_smoothing=0.1"] if trainer == "dpo" else []
    overrides = [f"{section}.lr=1e-4", f"{section}.max_grad_norm=1e9", f"{section}.max_length_per_device=100", *dpo]
    args = pair_args(trainer, model_dir, data, save_dir, 1, *overrides, *extra)[2:]  # without "-m rl2.trainer.X"
    return [STEP_WORKER, trainer, f"{save_dir}/step.pt", *args]


@pytest.mark.parametrize(
    "trainer,sequence_parallel", [("rm", False), ("dpo", False), ("rm", True), ("dpo", True)],
    ids=["rm", "dpo", "rm-sequence-parallel", "dpo-sequence-parallel"],
)
def test_one_step_is_world_size_invariant(one_rank_step, tiny_model_dir, pair_data, tmp_path, trainer, sequence_parallel):
    """The same batch gives the same metrics and gradients on 1 rank and on 2 ranks (2 data-parallel
    ranks, or one sequence-parallel pair splitting each row, with half the per-device budget), and the
    sharded AdamW step is the step those gradients give. (Parameters after AdamW are not compared
    across world sizes: its first step is ~lr * sign(g), so rounding in a near-zero gradient can move
    an element by up to lr either way, differently on every processor.)"""
    section = SECTION[trainer]
    one_dir, one = one_rank_step(trainer)
    two_dir = str(tmp_path / "two")
    extra = [f"{section}.sp_size=2", f"{section}.max_length_per_device=50"] if sequence_parallel else []
    run_torchrun(step_worker_args(trainer, tiny_model_dir, pair_data, two_dir, *extra))
    two = torch.load(f"{two_dir}/step.pt")

    ours, theirs = read_metrics(f"{two_dir}/metrics.jsonl"), read_metrics(f"{one_dir}/metrics.jsonl")
    assert [m["step"] for m in ours] == [m["step"] for m in theirs] == [0, 1] and theirs[1]["pairs"] == 16
    for ours_row, theirs_row in zip(ours, theirs):
        assert ours_row.keys() == theirs_row.keys()
        for key in theirs_row.keys() - TIMING_KEYS:
            if ours_row["step"] == 1 and key.startswith("test/"):
                continue  # the test set after the AdamW step (see above)
            # Sums over the same tokens, pairs (and, for grad_norm, ~1e5 squared gradients) in another
            # order: float32 rounding, up to ~2e-5 relative.
            assert ours_row[key] == pytest.approx(theirs_row[key], rel=1e-4, abs=1e-6), (ours_row["step"], key)

    assert len(one["steps"]) == len(two["steps"]) == 1 and two["steps"][0]["lr"] == one["steps"][0]["lr"] == 1e-4
    assert_same_gradients(two["steps"][0]["grads"], one["steps"][0]["grads"])
    for result in (one, two):
        assert max((result["after"][k] - result["before"][k]).abs().max().item() for k in result["replayed"]) > 5e-5
        for name, replayed in result["replayed"].items():
            # The same gradients through the same elementwise formula, sharded or not: at most a few
            # float32 spacings of the tensor's largest weight (2^-20 of it is 8); a wrong or missing
            # step is ~lr = 1e-4, far above.
            atol = 2**-20 * replayed.abs().max().item()
            torch.testing.assert_close(result["after"][name], replayed, rtol=0, atol=atol, msg=name)


# ---- reward model end to end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def rm_run(tiny_model_dir, pair_data, tmp_path_factory) -> str:
    save_dir = str(tmp_path_factory.mktemp("rm_run"))
    run_torchrun(pair_args("rm", tiny_model_dir, pair_data, save_dir, 12, "critic.save_freq=6"))
    return save_dir


def conversation(row: dict, field: str) -> list[dict]:
    return list(row["messages"]) + [{"role": "assistant", "content": row[field]}]


def test_reward_model_learns_reloads_and_scores_text(rm_run, pair_data):
    metrics = read_metrics(f"{rm_run}/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(13))  # step 0: the test set before training
    assert_metrics_documented(metrics)
    tests = [m for m in metrics if "test/accuracy" in m]
    assert [m["step"] for m in tests] == [0, 6, 12]
    assert tests[0]["test/accuracy"] < 0.7 and tests[-1]["test/accuracy"] >= 0.9, tests
    assert tests[-1]["test/loss"] < tests[0]["test/loss"] - 0.3
    assert tests[-1]["test/margin"] > 1.0
    assert all(m["pairs"] == 16 and m["grad_norm"] > 0 for m in metrics[1:])

    # The exported folder is a sequence classifier that reproduces the logged test loss and accuracy.
    final = f"{rm_run}/step12"
    scorer = RewardScorer(final, device="cpu", dtype=torch.float32)
    assert type(scorer.model).__name__ == "Qwen2ForSequenceClassification"
    test_set = PairDataset(f"{pair_data}/test.jsonl", scorer.tokenizer, None)
    rows = list(test_set.rows)
    chosen = torch.tensor([scorer.score(conversation(row, "chosen")) for row in rows])
    rejected = torch.tensor([scorer.score(conversation(row, "rejected")) for row in rows])
    loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean().item()
    # The same weights, one sequence at a time instead of packed: float32 rounding, ~1e-6.
    assert loss == pytest.approx(tests[-1]["test/loss"], abs=1e-4)
    assert (chosen > rejected).float().mean().item() == tests[-1]["test/accuracy"]
    # The scorer scores exactly what training saw.
    assert scorer.token_ids(conversation(rows[0], "chosen")) == test_set[0]["chosen"]["input_ids"].tolist()

    # The same folder as a token classifier: every token's score, the last one being the reward.
    token_model = AutoModelForTokenClassification.from_pretrained(final, dtype=torch.float32).eval()
    sequence_model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    ids = test_set[0]["rejected"]["input_ids"].unsqueeze(0)
    with torch.no_grad():  # the same weights and tokens through another head class: float32 rounding, ~1e-6
        per_token = token_model(input_ids=ids).logits[0, :, 0]
        assert per_token[-1].item() == pytest.approx(rejected[0].item(), abs=1e-5)
        assert sequence_model(input_ids=ids).logits[0, 0].item() == pytest.approx(rejected[0].item(), abs=1e-5)


def test_batched_scores_are_the_one_at_a_time_scores(rm_run, pair_data):
    """`score_many` (length-sorted, left-padded batches; what the search's PPM uses) gives `score`'s
    values, in input order, whatever the batch size."""
    scorer = RewardScorer(f"{rm_run}/step12", device="cpu", dtype=torch.float32)
    rows = list(load_rows(f"{pair_data}/test.jsonl"))
    conversations = [conversation(row, field) for row in rows for field in ("chosen", "rejected")]
    one_at_a_time = [scorer.score(messages) for messages in conversations]
    lengths = {len(scorer.token_ids(messages)) for messages in conversations}
    assert len(lengths) > 3  # the batches really pad
    for batch_tokens in (1, 256, 1 << 20):
        assert scorer.score_many(conversations, batch_tokens) == pytest.approx(one_at_a_time, abs=1e-5)
    assert scorer.score_many([]) == []


def test_env_file_serves_the_reward_model(rm_run, pair_data, monkeypatch):
    rows = list(load_rows(f"{pair_data}/test.jsonl"))[:8]
    monkeypatch.setenv("RL2_REWARD_MODEL", f"{rm_run}/step12")
    monkeypatch.setenv("RL2_REWARD_DEVICE", "cpu")
    with Env("envs/reward_model.py") as env:
        chosen = env.rewards([conversation(row, "chosen") for row in rows], [None] * len(rows))
        rejected = env.rewards([conversation(row, "rejected") for row in rows], [None] * len(rows))
        assert env._worker_pool is None  # async: scored in this process, no env worker loaded a copy
    assert all(result.error is None for result in chosen + rejected)
    scorer = RewardScorer(f"{rm_run}/step12", device="cpu")
    for row, result in zip(rows, chosen):
        assert result.value == pytest.approx(scorer.score(conversation(row, "chosen")), abs=1e-6)
    assert sum(c.value > r.value for c, r in zip(chosen, rejected)) >= 7

    monkeypatch.delenv("RL2_REWARD_MODEL")
    with pytest.raises(EnvError, match="RL2_REWARD_MODEL"):
        Env("envs/reward_model.py")


# ---- DPO end to end --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dpo_run(tiny_model_dir, pair_data, tmp_path_factory) -> str:
    save_dir = str(tmp_path_factory.mktemp("dpo_run"))
    run_torchrun(pair_args("dpo", tiny_model_dir, pair_data, save_dir, 12, "actor.save_freq=6"))
    return save_dir


def response_logps(model, sequence: dict) -> float:
    ids = sequence["input_ids"].unsqueeze(0)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        logps = token_logps(model(input_ids=ids, use_cache=False).logits, ids, positions)[0]
    return (logps * sequence["loss_mask"]).sum().item()


def test_dpo_learns_and_reloads(dpo_run, tiny_model_dir, pair_data):
    metrics = read_metrics(f"{dpo_run}/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(13))
    assert_metrics_documented(metrics)
    tests = [m for m in metrics if "test/accuracy" in m]
    # Before training the policy is the reference: every implicit reward is 0, every pair a tie.
    assert tests[0]["test/accuracy"] == 0.5 and tests[0]["test/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert tests[0]["test/margin"] == 0
    assert tests[-1]["test/accuracy"] >= 0.9 and tests[-1]["test/margin"] > 0.5, tests
    assert metrics[1]["loss"] == pytest.approx(math.log(2), abs=1e-6) and metrics[-1]["loss"] < 0.5
    assert all(m["reward/chosen"] > m["reward/rejected"] for m in metrics[2:])

    # The exported policy, against the starting model as reference, gives the logged test metrics
    # (unpacked, per sequence: float32 rounding of sums of tens of log-probs, ~1e-5 before beta).
    policy = AutoModelForCausalLM.from_pretrained(f"{dpo_run}/step12", dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    test_set = PairDataset(f"{pair_data}/test.jsonl", AutoTokenizer.from_pretrained(f"{dpo_run}/step12"), None)
    sequences = pair_sequences([test_set[i] for i in range(len(test_set))])
    ratios = [response_logps(policy, s) - response_logps(reference, s) for s in sequences]
    margins = torch.tensor([0.1 * (c - r) for c, r in zip(ratios[0::2], ratios[1::2])])  # actor.beta = 0.1
    assert -torch.nn.functional.logsigmoid(margins).mean().item() == pytest.approx(tests[-1]["test/loss"], abs=1e-4)
    assert margins.mean().item() == pytest.approx(tests[-1]["test/margin"], abs=1e-4)
    assert (margins > 0).float().mean().item() == tests[-1]["test/accuracy"]


# ---- resume, notebook, errors ----------------------------------------------------------------


@pytest.mark.parametrize("trainer", ["rm", "dpo"])
def test_resume_continues_exactly(request, tiny_model_dir, pair_data, tmp_path, trainer):
    """From the step-6 checkpoint of the 12-step run, a new run makes the same steps 7-12."""
    reference_dir = request.getfixturevalue(f"{trainer}_run")
    save_dir = tmp_path / "resumed"
    shutil.copytree(f"{reference_dir}/step6", save_dir / "step6")
    result = run_torchrun(
        pair_args(trainer, tiny_model_dir, pair_data, str(save_dir), 12, "trainer.load_ckpt_from=latest")
    )
    assert "resumed from" in result.stdout + result.stderr
    resumed = read_metrics(str(save_dir / "metrics.jsonl"))
    reference = read_metrics(f"{reference_dir}/metrics.jsonl")[7:]
    assert [m["step"] for m in resumed] == list(range(7, 13))
    for ours, theirs in zip(resumed, reference):
        assert ours.keys() == theirs.keys()
        for key in ours.keys() - TIMING_KEYS:
            # Exact resume replays the same arithmetic on the same machine and ranks (float32 weights and
            # AdamW state restored bit for bit): the steps agree to the last bit.
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (ours["step"], key)


def test_notebook_runs_both_trainers_in_one_process(tiny_model_dir, pair_data, tmp_path):
    """Both classes import from `rl2` and run one after the other in one process, without torchrun.
    The DPO reference is switched to offloading (a round trip through `model.to`, which on CPU
    moves nothing): its log-probs still equal the policy's at step 1, so the loss is log 2."""
    script = f"""
from rl2 import DPOTrainer, RMTrainer, load_config
common = ["data.path={pair_data}/train.jsonl", "data.batch_size=8", "trainer.total_steps=2", "trainer.disable_wandb=true"]
rm = RMTrainer(load_config(common + ["critic.model_name={tiny_model_dir}", "critic.save_dir={tmp_path}/rm"]))
rm.train()
dpo = DPOTrainer(load_config(common + ["actor.model_name={tiny_model_dir}", "actor.save_dir={tmp_path}/dpo"]))
dpo.reference.offload_model = True
dpo.train()
print("done")
"""
    assert "done" in run_python(["-c", script]).stdout
    for trainer in ("rm", "dpo"):
        metrics = read_metrics(f"{tmp_path}/{trainer}/metrics.jsonl")
        assert [m["step"] for m in metrics] == [1, 2]
        assert os.path.exists(f"{tmp_path}/{trainer}/step2/model.safetensors")
    assert read_metrics(f"{tmp_path}/dpo/metrics.jsonl")[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)


@pytest.mark.parametrize(
    "trainer,args,message",
    [
        ("rm", ["critic.model_name=M", "data.max_length=100", "critic.max_length_per_device=160"],
         "data.max_length=100 allows pairs of 200 tokens (chosen and rejected share a micro-batch), more than "
         "critic.max_length_per_device x critic.sp_size = 160"),
        ("dpo", ["actor.model_name=M", "actor.beta=0"], "actor.beta must be > 0, got 0.0"),
        ("dpo", ["actor.model_name=M", "actor.label_smoothing=0.5"], "actor.label_smoothing must be in [0, 0.5)"),
        ("dpo", ["actor.model_name=M", "actor.betta=1"], "unknown config key 'actor.betta'"),
    ],
)
def test_bad_configs_fail_before_anything_loads(tmp_path, trainer, args, message):
    """Checked before the process group, tokenizer or model: in this process, no torchrun."""
    from rl2 import DPOTrainer, RMTrainer

    with pytest.raises(ConfigError) as error:
        {"rm": RMTrainer, "dpo": DPOTrainer}[trainer](load_config([f"data.path={tmp_path}/x.jsonl", *args]))
    assert message in str(error.value)


def test_command_line_errors_are_one_clear_line(tiny_model_dir, tmp_path):
    from test_sft import run_python_raw

    misplaced = run_python_raw(["-m", "rl2.trainer.rm", "data.path=x.jsonl", "actor.model_name=M"])
    assert misplaced.returncode == 2 and "Traceback" not in misplaced.stderr, misplaced.stderr
    assert "rl2.trainer.rm does not read actor.model_name; did you mean critic.model_name?" in misplaced.stderr
    assert "rl2.trainer.rm trains the reward model in the critic section" in misplaced.stderr

    rows = tmp_path / "sft.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    sft_rows = run_python_raw(["-m", "rl2.trainer.dpo", f"data.path={rows}", f"actor.model_name={tiny_model_dir}",
                               "trainer.disable_wandb=true"])
    assert sft_rows.returncode == 2 and "missing column 'chosen'" in sft_rows.stderr, sft_rows.stderr
