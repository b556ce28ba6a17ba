"""FSDP2 on 2 gloo ranks gives the same update as 1 rank on the same global batch."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_same_gradients, run_python, run_torchrun

pytestmark = pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins

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
    "max_tokens,fsdp_size,n_sequences,logps_chunk_size",
    [(64, 0, 13, 0), (200, 0, 13, 0), (64, 1, 13, 0), (64, 0, 1, 0), (64, 0, 13, 5)],
    ids=["full-64", "full-200", "hybrid-64", "one-sequence-two-ranks", "chunked-logps"],
)
def test_two_ranks_match_one(
    single_rank, tiny_model_dir, tmp_path, max_tokens, fsdp_size, n_sequences, logps_chunk_size
):
    """With one sequence, rank 1 has nothing to train on and runs a placeholder row to join FSDP's
    collectives. The reference takes log-probs from full logits; "chunked-logps" takes them from the LM
    head 5 tokens at a time (chunks that do not divide the rows)."""
    single_rank = single_rank(n_sequences)
    out = str(tmp_path / "two.pt")
    hf_dir = str(tmp_path / "hf")
    run_torchrun([WORKER, tiny_model_dir, out, str(max_tokens), str(fsdp_size), str(n_sequences), hf_dir, "1",
                  str(logps_chunk_size)])
    two = torch.load(out)

    # The norm of ~1e5 squared gradients summed in another order: float32 rounding, up to ~2e-5 relative.
    assert two["metrics"]["grad_norm"] == pytest.approx(single_rank["metrics"]["grad_norm"], rel=1e-4)
    assert_same_step(two, single_rank)

    # The update moved the weights, so the comparison above means something.
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert max((initial[k] - v).abs().max().item() for k, v in two["params"].items()) > 1e-5

    # The HF export on rank 0 reloads and gives the trained model's log-probs.
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert os.path.exists(os.path.join(hf_dir, "config.json"))
    for name, value in reloaded.state_dict().items():  # a float32 copy of the same tensors: exact
        torch.testing.assert_close(value, two["params"][name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize(
    "max_tokens,n_sequences,logps_chunk_size", [(64, 13, 0), (40, 1, 0), (64, 13, 5)],
    ids=["13-sequences", "one-sequence", "chunked-logps"],
)
def test_sequence_parallel_matches_one_rank(single_rank, tiny_model_dir, tmp_path, max_tokens, n_sequences, logps_chunk_size):
    """sp=2 on 2 ranks (ZigZag ring attention, each row split over both ranks) gives the same
    loss, gradients, parameters and log-probs as one rank (with full logits)."""
    reference = single_rank(n_sequences)
    out = str(tmp_path / "sp.pt")
    run_torchrun([WORKER, tiny_model_dir, out, str(max_tokens), "0", str(n_sequences), "-", "2", str(logps_chunk_size)])
    sp = torch.load(out)
    assert_same_step(sp, reference)


def test_compiled_layers_match_eager(single_rank, tiny_model_dir, tmp_path):
    """actor.compile=true (each decoder layer compiled, under FSDP2 and checkpointing) gives the eager
    step, with chunked log-probs."""
    out = str(tmp_path / "compiled.pt")
    run_python([WORKER, tiny_model_dir, out, "64", "0", "13", "-", "1", "16", "1"])
    assert_same_step(torch.load(out), single_rank(13))


def assert_same_step(ours: dict, reference: dict) -> None:
    """A worker's step equals the reference's: the loss, gradients and log-probs before the step, where
    only the order of float32 sums differs; and the parameters after it equal AdamW's step replayed in
    one process from the worker's own gradients. (Parameters after AdamW are not compared across world
    sizes: its first step is ~lr * sign(g), so rounding in a near-zero gradient can move an element by
    up to lr either way, differently on every processor.)"""
    assert ours["metrics"]["loss_tokens"] == reference["metrics"]["loss_tokens"]
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= ours["grads"].keys()  # the root module's too
    # A per-token mean of ~7 (1024-token vocabulary) over a few hundred tokens: float32 rounding, ~1e-6 relative.
    assert ours["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], rel=1e-5)
    assert_same_gradients(ours["grads"], reference["grads"])
    for a, b in zip(ours["logps"], reference["logps"], strict=True):
        # Log-probs of magnitude ~7 from another packing and sharding: float32 rounding, ~1e-6.
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert ours["replayed"].keys() == reference["grads"].keys()
    for name, replayed in ours["replayed"].items():
        # The same gradients through the same elementwise formula, sharded or not: at most a few float32
        # spacings of the tensor's largest weight (2^-20 of it is 8 of them); a wrong or missing
        # step is ~lr = 1e-4, far above.
        atol = 2**-20 * replayed.abs().max().item()
        torch.testing.assert_close(ours["params"][name], replayed, rtol=0, atol=atol, msg=name)


def test_final_barrier_accepts_a_peer_that_already_left(monkeypatch):
    """A peer that passed the last barrier and exited shows up as a reset connection: the run is
    still done. Any other barrier failure is raised."""
    from rl2.distributed import process_group as distributed

    def barrier_failing_with(message):
        def barrier():
            raise RuntimeError(message)
        return barrier

    monkeypatch.setattr(distributed, "barrier", barrier_failing_with(
        "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:59267: Connection reset by peer."))
    distributed.shutdown_distributed()
    monkeypatch.setattr(distributed, "barrier", barrier_failing_with("Timed out waiting 1800000ms for recv"))
    with pytest.raises(RuntimeError, match="Timed out"):
        distributed.shutdown_distributed()


@pytest.mark.parametrize("fused", [False, True])
def test_offloaded_optimizer_comes_back_with_adams_step_on_the_cpu(fused):
    """Moving the optimizer back moves Adam's moments but not its `step` counts, unless fused (whose
    kernel reads them on the device): a device `step` costs foreach Adam one host sync per tensor."""
    from rl2.distributed.fsdp import move_optimizer

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    move_optimizer(optimizer, "cpu")
    move_optimizer(optimizer, "meta")  # stands for the accelerator
    for state in optimizer.state.values():
        assert state["exp_avg"].device.type == state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == ("meta" if fused else "cpu")


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_one_rank_keeps_layers_gathered_across_micro_batches(tiny_model_dir, tmp_path, dtype):
    """On one rank the layers are gathered once a step and the gradients reduced once (not per micro-batch,
    forward and backward): the same gradients, parameters after the step, metrics and log-probs after it, bit
    for bit, in fp32 and with bf16 compute (whose gradients FSDP2 accumulates in fp32 either way)."""
    out = str(tmp_path / "steps.pt")
    run_python(["tests/workers/one_rank_accumulation.py", tiny_model_dir, out, dtype])
    kept, per_micro_batch = torch.load(out)[True], torch.load(out)[False]
    assert kept["rows"] == per_micro_batch["rows"] >= 4
    assert all(lengths == sorted(lengths) for lengths in kept["row_lengths"])  # packed by length (CPU attention's slices)
    for name, grad in per_micro_batch["grads"].items():
        assert torch.equal(kept["grads"][name], grad), name
    for name, param in per_micro_batch["params"].items():
        assert torch.equal(kept["params"][name], param), name
    assert kept["metrics"] == per_micro_batch["metrics"]
    for a, b in zip(kept["logps"], per_micro_batch["logps"], strict=True):
        assert torch.equal(a, b)
    # Per micro-batch: each FSDP group (2 layers, the root) gathered in forward and each layer again in
    # backward, every group's gradient reduced; kept: each group once a step.
    rows, groups = kept["rows"], 3
    assert per_micro_batch["counts"] == {"all_gather": rows * (groups + 2), "reduce_scatter": rows * groups}
    assert kept["counts"] == {"all_gather": groups, "reduce_scatter": groups}
