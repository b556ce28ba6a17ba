"""A vision-language policy's log-probs and SFT gradients over one packed row of samples with and without
images, with sequence parallelism `SP_SIZE` over all ranks (1: one rank, the reference); the vision tower
trains (actor.freeze_vision=false). Rank 0 saves every token's log-prob, also those of the samples without
images alone in a row (with the placeholder image), the loss and the full gradients.

Usage: vision_sp_step.py MODEL_DIR SAMPLES_FILE OUT_FILE SP_SIZE [LOGPS_CHUNK_SIZE]
SAMPLES_FILE: torch.save'd list of samples (rl2.vision.inputs.build_vision_sample).
"""

import sys

import torch

from rl2.algorithms.losses import sft_loss, with_loss_weights
from rl2.config import ActorConfig
from rl2.distributed.process_group import exit_process, init_distributed, is_rank0, world_size
from rl2.workers.policy import Policy


def main() -> None:
    model_dir, samples_file, out_file, sp_size = *sys.argv[1:4], int(sys.argv[4])
    init_distributed()
    assert sp_size == world_size(), "one data-parallel group: the whole batch in one row"
    config = ActorConfig(model_name=model_dir, dtype="float32", sp_size=sp_size, max_length_per_device=4096,
                         logps_chunk_size=int(sys.argv[5]) if len(sys.argv) > 5 else 0, freeze_vision=False,
                         max_grad_norm=1e9)
    actor = Policy(config, total_steps=1)
    samples = torch.load(samples_file)
    grads: dict[str, torch.Tensor] = {}

    def capture(*_) -> None:  # the gradients the optimizer steps with, in full
        for name, p in actor.model.named_parameters():
            if p.grad is not None:
                grads[name] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()

    actor.optimizer.register_step_pre_hook(capture)
    # Every token's log-prob (no loss mask: none is skipped), before the backward: a no-grad forward after it
    # would leave FSDP2's root gathered without its gradients.
    unmasked = [{k: v for k, v in sample.items() if k != "loss_mask"} for sample in samples]
    logps = actor.compute(unmasked)
    # A row without images: its placeholder image's one token is in one rank's share only.
    text_logps = actor.compute([sample for sample in unmasked if "pixel_values" not in sample])
    metrics = actor.accumulate_gradients(with_loss_weights(samples), sft_loss)
    actor.optimizer_step()
    if is_rank0():
        torch.save({"logps": logps, "text_logps": text_logps, "loss": metrics["loss"], "grads": grads}, out_file)


if __name__ == "__main__":
    main()
    exit_process(0)
