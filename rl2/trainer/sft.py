"""Supervised fine-tuning: `torchrun --nproc_per_node=N -m rl2.trainer.sft key=value ...`."""

import torch

from rl2.algorithms.losses import sft_loss, with_loss_weights
from rl2.data.conversations import SFTDataset
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
        return self.reading_images(SFTDataset)

    def build_models(self) -> Policy:
        self.actor = Policy(self.config.actor, self.total_steps)
        self.loss_fn = sft_loss
        return self.actor

    def sequences(self, rows: list) -> list[dict[str, torch.Tensor]]:
        return with_loss_weights(rows)


def main() -> None:
    run_main(lambda config: SFTTrainer(config).train(), "sft")


if __name__ == "__main__":
    main()
