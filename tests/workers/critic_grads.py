"""The critic's gradients of one value loss in float32 and in bfloat16 (FSDP2, one rank), with the
warnings each raised, and a plain transformers float32 reference. Saved to OUT_FILE.

Usage: critic_grads.py MODEL_DIR OUT_FILE
"""

import sys
import warnings

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from rl2.algorithms.losses import value_loss
from rl2.config import ModelConfig
from rl2.distributed.process_group import exit_process, init_distributed
from rl2.workers.critic import Critic

CLIP = 0.5


def batch(vocab_size: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    sequences = []
    for length in (23, 9, 31):
        action_mask = (torch.rand(length, generator=generator) < 0.7).float()
        action_mask[0] = 0
        sequences.append({
            "input_ids": torch.randint(0, vocab_size, (length,), generator=generator),
            "action_mask": action_mask, "loss_mask": action_mask,
            "old_values": torch.randn(length, generator=generator) * 0.1,
            "returns": torch.randn(length, generator=generator),
            "loss_weight": action_mask / action_mask.sum() / 3,
        })
    return sequences


def loss_fn(outputs: dict, micro_batch: dict) -> tuple[torch.Tensor, dict]:
    loss, _ = value_loss(outputs["values"], micro_batch["old_values"], micro_batch["returns"], CLIP)
    return (loss * micro_batch["loss_weight"]).sum(), {}


def main() -> None:
    model_dir, out_file = sys.argv[1], sys.argv[2]
    init_distributed()
    results = {}
    for dtype in ("float32", "bfloat16"):
        torch.manual_seed(0)  # the head is newly initialised: the same one in both
        critic = Critic(ModelConfig(model_name=model_dir, dtype=dtype, gradient_checkpointing=True,
                                    max_length_per_device=40), total_steps=1)
        sequences = batch(critic.model.config.vocab_size)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            critic.accumulate_gradients(sequences, loss_fn)
        grads = {name: param.grad.full_tensor().detach().clone() for name, param in critic.model.named_parameters()}
        head = {name: param.full_tensor().detach().clone() for name, param in critic.model.named_parameters()
                if name.startswith("score.")}
        results[dtype] = {"grads": grads, "warnings": [str(w.message) for w in caught], "head": head}

    # The reference: plain transformers with the critic's head, fp32, one sequence at a time.
    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(model_dir, config=config, dtype=torch.float32)
    model.load_state_dict(results["float32"]["head"], strict=False)
    model.config.use_cache = False
    for sequence in batch(model.config.vocab_size):
        scores = model(input_ids=sequence["input_ids"][None]).logits[0, :, 0]
        values = torch.cat([scores.new_zeros(1), scores[:-1]])
        loss, _ = value_loss(values, sequence["old_values"], sequence["returns"], CLIP)
        (loss * sequence["loss_weight"]).sum().backward()
    results["reference"] = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    torch.save(results, out_file)
    exit_process(0)


if __name__ == "__main__":
    main()
