"""One LoRA actor update on a fixed random batch; rank 0 saves what the LoRA tests compare.

Usage: lora_step.py MODEL_DIR OUT_FILE SAVE_DIR [SP_SIZE] [LOGPS_CHUNK_SIZE]

Saved: the full state dict before and after the step (peft names), the metrics, the policy's log-probs
after the step and its reference's (adapters disabled) before and after, the batch, and the log-probs the
embedded engine gives after a LoRA sync (only the adapted weights sent, merged) of its own generations
together with the actor's log-probs of the same tokens. SAVE_DIR gets the adapter and the merged model.
"""

import os
import sys

import torch
from transformers import AutoTokenizer

from fsdp_step import random_batch
from rl2.algorithms.losses import sft_loss, with_loss_weights
from rl2.checkpoint import save_hf_model
from rl2.config import LoraConfig, ModelConfig
from rl2.distributed.fsdp import gather_full_state_dict
from rl2.distributed.process_group import exit_process, init_distributed, is_rank0
from rl2.engines import HFEngine, SamplingParams
from rl2.lora import AdaptersOff
from rl2.rollout.weight_sync import iter_full_weights
from rl2.workers.policy import Policy

LORA = LoraConfig(rank=4, alpha=8.0)


def main() -> None:
    model_dir, out_file, save_dir = sys.argv[1:4]
    init_distributed()
    config = ModelConfig(
        model_name=model_dir, dtype=os.environ.get("LORA_DTYPE", "float32"), gradient_checkpointing=True, max_length_per_device=64, lr=1e-2,
        weight_decay=0.1, max_grad_norm=1e9, warmup_ratio=0.0, lora=LORA,
        sp_size=int(sys.argv[4]) if len(sys.argv) > 4 else 1,
        logps_chunk_size=int(sys.argv[5]) if len(sys.argv) > 5 else 0,
    )
    actor = Policy(config, total_steps=10)
    reference = AdaptersOff(actor)
    batch = random_batch(actor.model.config.vocab_size, 13)
    before = {name: tensor.clone() for name, tensor in gather_full_state_dict(actor.model).items()}
    ref_before = reference.compute(batch)
    trainable = sorted(name for name, p in actor.model.named_parameters() if p.requires_grad)
    optimizer_numel = sum(p.numel() for group in actor.optimizer.param_groups for p in group["params"])
    metrics = actor.train_step(with_loss_weights(batch), sft_loss)
    after = gather_full_state_dict(actor.model)
    logps, ref_after = actor.compute(batch), reference.compute(batch)
    save_hf_model(actor.model, save_dir, "float32", merged=True)

    engine = HFEngine(model_dir, AutoTokenizer.from_pretrained(model_dir), "cpu", dtype="float32", seed=1)
    sent = []

    def recorded(stream):
        for name, tensor in stream:
            sent.append(name)
            yield name, tensor

    engine.update_weights(recorded(iter_full_weights(actor.model, "float32", 1, adapted_only=True)), partial=True)
    prompts = [[5, 9, 13, 2], [7, 7, 3]]
    generations = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True))
    sequences = [{"input_ids": torch.tensor(p + g.token_ids), "loss_mask": torch.tensor([0] * len(p) + [1] * len(g.token_ids))}
                 for p, g in zip(prompts, generations)]
    actor_logps = [lp[len(p):] for lp, p in zip(actor.compute(sequences), prompts)]
    if is_rank0():
        torch.save({"before": before, "after": after, "metrics": metrics, "logps": logps, "ref_before": ref_before,
                    "ref_after": ref_after, "batch": batch, "trainable": trainable, "optimizer_numel": optimizer_numel,
                    "sent": sent, "engine_logps": [torch.tensor(g.logprobs) for g in generations],
                    "actor_logps": actor_logps}, out_file)


if __name__ == "__main__":
    main()
    exit_process(0)
