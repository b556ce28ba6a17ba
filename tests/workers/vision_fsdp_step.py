"""A packed vision-language forward and backward under FSDP2, one packed row per rank; rank 0 saves the
full gradients. A rank whose samples have no image gets the placeholder image (rl2.vision.placeholder).

Usage: vision_fsdp_step.py MODEL_DIR SAMPLES_FILE OUT_FILE
SAMPLES_FILE: torch.save'd list (one entry per rank) of lists of samples (rl2.vision.inputs.build_vision_sample).
Each rank's loss is the summed next-token cross-entropy over its loss-mask tokens.
"""

import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText

from rl2.distributed.fsdp import load_fsdp_model
from rl2.distributed.process_group import build_fsdp_mesh, exit_process, init_distributed, is_rank0, rank
from rl2.vision.forward import packed_vision_forward, vision_attention_implementation
from rl2.vision.placeholder import with_placeholder_image
from rl2.vision.positions import pack_vision_samples, rope_index_of


def main() -> None:
    model_dir, samples_file, out_file = sys.argv[1:4]
    init_distributed()
    cpu = torch.device("cpu")
    model = load_fsdp_model(model_dir, build_fsdp_mesh(0), cpu, dtype="float32", model_cls=AutoModelForImageTextToText,
                            attn_implementation=vision_attention_implementation(cpu))
    samples = with_placeholder_image(torch.load(samples_file)[rank()], model.config)
    row = pack_vision_samples(samples, rope_index_of(model))
    logits = packed_vision_forward(model, row)[0]
    losses = F.cross_entropy(logits[:-1], row["input_ids"][0, 1:], reduction="none")
    # a sequence's last token predicts the next sequence's first: loss_mask is 0 at every sequence start
    (losses * row["loss_mask"][0, 1:]).sum().backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    if is_rank0():
        torch.save({"grads": grads, "n_images": int(row["image_grid_thw"].shape[0])}, out_file)


if __name__ == "__main__":
    main()
    exit_process(0)
