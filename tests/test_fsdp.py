"""FSDP2 on 2 gloo ranks gives the same update as 1 rank on the same global batch."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import run_python, run_torchrun

WORKER = "tests/workers/fsdp_step.py"


@pytest.fixture(scope="module")
def single_rank(tiny_model_dir, tmp_path_factory):
    """The 1-rank reference, everything in one micro-batch, per batch size."""
    results = {}

    def result(n_sequences: int) -> dict:
        if n_sequences not in results:
            out = str(tmp_path_factory.mktemp("fsdp") / "one.pt")
            run_python([WORKER, tiny_model_dir, out, "100000", "0", str(n_sequences)])
            results[n_sequences] = torch.load(out)
        return results[n_sequences]

    return result


@pytest.mark.parametrize(
    "max_tokens,fsdp_size,n_sequences",
    [(64, 0, 13), (200, 0, 13), (64, 1, 13), (64, 0, 1)],
    ids=["full-64", "full-200", "hybrid-64", "one-sequence-two-ranks"],
)
def test_two_ranks_match_one(single_rank, tiny_model_dir, tmp_path, max_tokens, fsdp_size, n_sequences):
    """With one sequence, rank 1 has nothing to train on and runs a placeholder row to join FSDP's collectives."""
    single_rank = single_rank(n_sequences)
    out = str(tmp_path / "two.pt")
    hf_dir = str(tmp_path / "hf")
    run_torchrun([WORKER, tiny_model_dir, out, str(max_tokens), str(fsdp_size), str(n_sequences), hf_dir])
    two = torch.load(out)

    assert abs(two["metrics"]["grad_norm"] - single_rank["metrics"]["grad_norm"]) < 1e-5
    assert two["grads"].keys() == single_rank["grads"].keys()
    assert_same_step(two, single_rank, grad_atol=1e-6)

    # The update moved the weights, so the comparison above means something.
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert max((initial[k] - v).abs().max().item() for k, v in two["params"].items()) > 1e-5

    # The HF export on rank 0 reloads and gives the trained model's log-probs.
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert os.path.exists(os.path.join(hf_dir, "config.json"))
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, two["params"][name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("max_tokens,n_sequences", [(64, 13), (40, 1)], ids=["13-sequences", "one-sequence"])
def test_sequence_parallel_matches_one_rank(single_rank, tiny_model_dir, tmp_path, max_tokens, n_sequences):
    """sp=2 on 2 ranks (ZigZag ring attention, each row split over both ranks) gives the same
    loss, gradients, parameters and log-probs as one rank."""
    reference = single_rank(n_sequences)
    out = str(tmp_path / "sp.pt")
    run_torchrun([WORKER, tiny_model_dir, out, str(max_tokens), "0", str(n_sequences), "-", "2"])
    sp = torch.load(out)
    assert_same_step(sp, reference, grad_atol=1e-5)


def assert_same_step(ours: dict, reference: dict, grad_atol: float) -> None:
    """A worker's step (loss, gradients, parameters, log-probs) equals the reference's."""
    assert ours["metrics"]["loss_tokens"] == reference["metrics"]["loss_tokens"]
    assert abs(ours["metrics"]["loss"] - reference["metrics"]["loss"]) < 1e-5
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(ours["grads"][name], grad, atol=grad_atol, rtol=0, msg=name)
    for name, param in reference["params"].items():
        torch.testing.assert_close(ours["params"][name], param, atol=1e-5, rtol=0, msg=name)
    for a, b in zip(ours["logps"], reference["logps"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
