"""Supervised fine-tuning: `torchrun --nproc_per_node=N -m rl2.trainer.sft key=value ...`."""

import os

import torch

from rl2.algorithms.losses import sft_loss, with_loss_weights
from rl2.checkpoint import checkpoint_dir
from rl2.data.conversations import SFTDataset
from rl2.data.image_rows import ImageInputs
from rl2.distributed.process_group import is_rank0
from rl2.trainer.base import run_main
from rl2.trainer.offline import OfflineTrainer
from rl2.workers.policy import Policy


class SFTTrainer(OfflineTrainer):
    """Next-token loss on the assistant turns of `{"messages": [...]}` rows, a per-token mean over the
    batch (and over the test set). A vision-language actor (Qwen2.5-VL, Qwen3-VL) trains on rows with
    images (`data.image_key`), its vision tower frozen unless `actor.freeze_vision=false`."""

    name = "SFT"
    dataset_cls = SFTDataset

    def dataset_class(self) -> type:
        self.image_inputs = ImageInputs.for_model(self.config.actor.model_name, self.config.data)
        return SFTDataset if self.image_inputs is None else SFTDataset.reading_images(self.image_inputs)

    def build_models(self) -> Policy:
        self.actor = Policy(self.config.actor, self.total_steps)
        self.loss_fn = sft_loss
        return self.actor

    def sequences(self, rows: list) -> list[dict[str, torch.Tensor]]:
        return with_loss_weights(rows)

    def save(self, step: int) -> str:
        if self.image_inputs is not None and is_rank0():  # the checkpoint loads as a model that reads images
            path = checkpoint_dir(self.main_config.save_dir, step)
            os.makedirs(path, exist_ok=True)
            self.image_inputs.image_processor.save_pretrained(path)
        return super().save(step)


def main() -> None:
    run_main(lambda config: SFTTrainer(config).train(), "sft")


if __name__ == "__main__":
    main()
