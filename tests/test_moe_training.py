"""MoE and hybrid models under rl2's workers: packed rows through `Policy` (FSDP2, gloo) against plain
transformers forwards of each sequence alone, on tiny models built offline, in fp32 on CPU."""

import pytest

from conftest import run_python, run_torchrun
from rl2.testing.tiny_moe import save_tiny_moe

HYBRID_POLICY = """
import sys, torch
from transformers import AutoModelForCausalLM
from rl2.workers.policy import Policy, token_logps
from rl2.config import ModelConfig
from rl2.distributed.process_group import init_distributed, rank
init_distributed()
folder = sys.argv[1]
config = ModelConfig(model_name=folder, dtype="float32", max_length_per_device=256, lr=1e-3, gradient_checkpointing=False)
actor = Policy(config, total_steps=1)
generator = torch.Generator().manual_seed(2)
lengths = (5, 70, 17, 17, 30)
sequences = [{"input_ids": torch.randint(0, 1000, (n,), generator=generator), "loss_mask": torch.ones(n),
              "loss_weight": torch.full((n,), 1.0 / sum(lengths))} for n in lengths]
ours = actor.compute(sequences)
plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
expected, loss = [], 0.0
for seq in sequences:
    ids = seq["input_ids"].unsqueeze(0)
    logps = token_logps(plain(input_ids=ids, use_cache=False).logits, ids, torch.arange(ids.shape[1]).unsqueeze(0))[0]
    expected.append(logps.detach())
    loss = loss - (logps * seq["loss_weight"]).sum()
loss.backward()
worst = max((got - want).abs().max().item() for got, want in zip(ours, expected))

def loss_fn(outputs, row):
    return -(outputs["logps"] * row["loss_weight"]).sum(), {}

actor.accumulate_gradients(sequences, loss_fn)
plain_grads = dict(plain.named_parameters())
grad_worst = 0.0
for name, parameter in actor.model.named_parameters():
    grad = parameter.grad.full_tensor() if hasattr(parameter.grad, "full_tensor") else parameter.grad
    grad_worst = max(grad_worst, (grad - plain_grads[name].grad).abs().max().item())
if rank() == 0:
    print("logps_difference", worst, "grad_difference", grad_worst)
"""


@pytest.fixture(scope="module")
def tiny_hybrid_dir(tmp_path_factory):
    return save_tiny_moe(str(tmp_path_factory.mktemp("tiny_qwen3_5")), "qwen3_5")


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_hybrid_policy_on_packed_rows_gives_each_sequences_logps_and_gradients_alone(tiny_hybrid_dir, nproc):
    """Qwen3.5 (gated delta-nets beside full attention) under `Policy`: its packed rows' log-probs and the
    gradients of a loss over them equal plain transformers forwards of each sequence alone."""
    args = ["-c", HYBRID_POLICY, tiny_hybrid_dir]
    result = run_python(args) if nproc == 1 else run_torchrun(args, nproc=nproc)
    logps, grads = result.stdout.split("logps_difference")[-1].split()[0::2]
    assert float(logps) < 1e-5 and float(grads) < 1e-5, result.stdout
