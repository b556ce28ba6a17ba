"""One actor update on a fixed random global batch; rank 0 saves gradients, parameters and metrics.

Usage: fsdp_step.py MODEL_DIR OUT_FILE MAX_TOKENS FSDP_SIZE N_SEQUENCES [HF_SAVE_DIR|-] [SP_SIZE] [LOGPS_CHUNK_SIZE] [COMPILE]

LOGPS_CHUNK_SIZE: actor.logps_chunk_size (0 = full logits, the default here: the reference computation);
COMPILE: 1 for actor.compile.

Saved: the metrics, the log-probs of the batch and the gradients the optimizer stepped with (both
before the step), the parameters after the step, and "replayed": the parameters that AdamW gives from
the same start and those gradients in one process (step_capture.py). What depends on the world size
is compared before the step; the sharded step is compared with its replay on the same gradients.
"""

import sys

import torch

from rl2.workers.policy import Policy
from rl2.algorithms.losses import sft_loss, with_loss_weights
from rl2.checkpoint import save_hf_model
from rl2.config import ModelConfig
from rl2.distributed.process_group import exit_process, init_distributed, is_rank0
from rl2.distributed.fsdp import gather_full_state_dict
from step_capture import capture_steps, replay_adamw


def random_batch(vocab_size: int, n: int = 13, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for _ in range(n):
        length = int(torch.randint(2, 60, (1,), generator=generator))
        loss_mask = (torch.rand(length, generator=generator) < 0.7).long()
        loss_mask[0] = 0
        batch.append({"input_ids": torch.randint(0, vocab_size, (length,), generator=generator), "loss_mask": loss_mask})
    return batch


def main() -> None:
    model_dir, out_file, max_tokens, fsdp_size, n_sequences = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    init_distributed()
    config = ModelConfig(
        model_name=model_dir, dtype="float32", gradient_checkpointing=True, max_length_per_device=max_tokens,
        lr=1e-4, weight_decay=0.1, max_grad_norm=1e9, fsdp_size=fsdp_size,
        sp_size=int(sys.argv[7]) if len(sys.argv) > 7 else 1,
        logps_chunk_size=int(sys.argv[8]) if len(sys.argv) > 8 else 0,
        compile=len(sys.argv) > 9 and sys.argv[9] == "1",
    )
    torch.manual_seed(0)
    actor = Policy(config, total_steps=10)
    batch = random_batch(actor.model.config.vocab_size, n_sequences)
    # cloned: on one CPU rank the full state dict shares memory with the parameters
    before = {name: tensor.clone() for name, tensor in gather_full_state_dict(actor.model).items()}
    steps = capture_steps(actor.model, actor.optimizer)
    # Before the backward: a no-grad forward leaves FSDP2's root module (embeddings, final norm) gathered, and
    # `named_parameters` then shows its unsharded tensors, without the gradients the optimizer steps with.
    logps = actor.compute(batch)
    metrics = actor.accumulate_gradients(with_loss_weights(batch), sft_loss)
    metrics["grad_norm"] = actor.optimizer_step()
    params = gather_full_state_dict(actor.model)
    if len(sys.argv) > 6 and sys.argv[6] != "-":
        save_hf_model(actor.model, sys.argv[6], "float32")
    if is_rank0():
        replayed = replay_adamw(before, steps, actor.optimizer)
        torch.save(
            {"grads": steps[0]["grads"], "params": params, "replayed": replayed, "metrics": metrics, "logps": logps,
             "batch": batch},
            out_file,
        )


if __name__ == "__main__":
    main()
    exit_process(0)  # see its docstring: gloo can abort a finished rank during interpreter teardown
