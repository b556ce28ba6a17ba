"""A forward over a packed row gives the same per-token log-probs as separate forwards."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_same_gradients, run_python
from rl2.workers.policy import token_logps
from rl2.kernels.attention import cu_seqlens_from_position_ids, packed_attention_implementation
from rl2.distributed.packing import pack_micro_batch, unpack_row


@pytest.mark.parametrize("attention", ["sdpa", "rl2_varlen"])
def test_packed_logps_equal_unpacked(tiny_model_dir, attention):
    if attention == "rl2_varlen":
        attention = packed_attention_implementation(torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=attention
    ).eval()
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 7, 33, 2, 19, 64]
    sequences = [{"input_ids": torch.randint(0, 1000, (n,), generator=generator)} for n in lengths]

    row = pack_micro_batch(sequences)
    with torch.no_grad():
        logits = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
        packed = unpack_row(token_logps(logits, row["input_ids"], row["position_ids"]), row["cu_seqlens"])
        for seq, packed_logps in zip(sequences, packed):
            ids = seq["input_ids"].unsqueeze(0)
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            alone = token_logps(model(input_ids=ids, use_cache=False).logits, ids, positions)[0]
            assert packed_logps.shape == alone.shape
            # Log-probs of magnitude ~7 (1024-token vocabulary) from another kernel and row length:
            # float32 rounding, ~1e-6.
            torch.testing.assert_close(packed_logps, alone, atol=1e-5, rtol=0)
            assert packed_logps[0] == 0  # nothing predicts a sequence's first token

        # Without per-sequence positions the sequences would leak into each other: the test can fail.
        leaky = model(input_ids=row["input_ids"], use_cache=False).logits
        leaky_logps = unpack_row(token_logps(leaky, row["input_ids"], row["position_ids"]), row["cu_seqlens"])
        assert (leaky_logps[-1] - packed[-1]).abs().max() > 1e-3


def test_token_logps_match_log_softmax():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 6, 11, generator=generator)
    ids = torch.randint(0, 11, (1, 6), generator=generator)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    logps = token_logps(logits, ids, positions)[0]
    reference = torch.log_softmax(logits[0], -1)
    for t in range(6):
        expected = 0.0 if positions[0, t] == 0 else reference[t - 1, ids[0, t]].item()
        assert abs(logps[t].item() - expected) < 1e-6  # log-probs ~2.4 (11 classes): a few float32 spacings


def test_packed_gradients_equal_unpacked(tiny_model_dir):
    """The variable-length path also gives the gradients of separate forwards."""
    attention = packed_attention_implementation(torch.device("cpu"))
    packed_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attention)
    plain_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(2)
    sequences = [{"input_ids": torch.randint(0, 1000, (n,), generator=generator)} for n in (5, 1, 40, 17)]

    row = pack_micro_batch(sequences)
    logits = packed_model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
    token_logps(logits, row["input_ids"], row["position_ids"]).sum().backward()
    for seq in sequences:
        ids = seq["input_ids"].unsqueeze(0)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        token_logps(plain_model(input_ids=ids, use_cache=False).logits, ids, positions).sum().backward()
    packed = {name: param.grad for name, param in packed_model.named_parameters()}
    assert_same_gradients(packed, {name: param.grad for name, param in plain_model.named_parameters()})


def test_cu_seqlens_from_position_ids():
    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 0, 1, 2, 3]])
    assert cu_seqlens_from_position_ids(positions).tolist() == [0, 3, 4, 6, 10]


POLICY_WORKER = """
import sys, torch
from transformers import AutoModelForCausalLM
from rl2.workers.policy import Policy, token_logps
from rl2.config import ModelConfig
from rl2.distributed.process_group import init_distributed
init_distributed()
folder, chunk, temperature = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
config = ModelConfig(model_name=folder, dtype="float32", max_length_per_device=128, lr=1e-4, logps_chunk_size=chunk,
                     gradient_checkpointing=False)
actor = Policy(config, total_steps=1, temperature=temperature)
generator = torch.Generator().manual_seed(2)
sequences = [{"input_ids": torch.randint(0, 1000, (n,), generator=generator)} for n in (5, 40, 17, 1, 30)]
ours = actor.compute(sequences)
plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
worst = 0.0
with torch.no_grad():
    for seq, got in zip(sequences, ours):
        ids = seq["input_ids"].unsqueeze(0)
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        expected = token_logps(plain(input_ids=ids, use_cache=False).logits, ids, positions, temperature)[0]
        worst = max(worst, (got - expected).abs().max().item())
print("max_difference", worst)
# With loss masks the head runs only where a token in the loss is predicted; the other positions read 0.
masks = [(torch.rand(len(seq["input_ids"]), generator=generator) < 0.5).float() for seq in sequences]
head_rows = []
actor.model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[1]))
masked = actor.compute([{**seq, "loss_mask": mask} for seq, mask in zip(sequences, masks)])
loss_worst = max(((got - full) * mask).abs().max().item() for got, full, mask in zip(masked, ours, masks))
outside = max((got * (1 - mask)).abs().max().item() for got, mask in zip(masked, masks))
print("head_rows", sum(head_rows), int(sum(mask[1:].sum() for mask in masks)), "loss_tokens_difference", loss_worst,
      "outside", outside)
"""


@pytest.mark.parametrize("chunk,temperature", [(0, 1.0), (0, 0.7), (16, 0.7)], ids=["full", "full-t0.7", "chunked-t0.7"])
def test_policy_forward_agrees_with_token_logps(tiny_model_dir, chunk, temperature):
    """What training uses (`Policy.forward` through `Policy.compute`: packed rows, full logits or the
    chunked head, the sampling temperature) equals `token_logps`, the function the tests above
    check, on the plain model one sequence at a time; with loss masks, at the loss tokens (the head
    runs on those positions only)."""
    result = run_python(["-c", POLICY_WORKER, tiny_model_dir, str(chunk), str(temperature)])
    difference = float(result.stdout.split("max_difference")[-1].split()[0])
    assert difference < 1e-5, difference  # float32 rounding of another kernel and row length
    seen, scored, _, loss_difference, _, outside = result.stdout.split("head_rows")[-1].split()
    assert int(seen) == int(scored)  # the head ran on the positions that predict a loss token, only
    assert float(loss_difference) < 1e-5 and float(outside) == 0
