"""Supervised fine-tuning: `torchrun --nproc_per_node=N -m rl2.trainer.sft key=value ...`."""

import sys

import torch

from rl2.workers.policy import Policy
from rl2.algorithms.losses import sft_loss
from rl2.config import load_config
from rl2.data.conversations import SFTDataset
from rl2.distributed.process_group import exit_process
from rl2.trainer.base import user_errors_reported
from rl2.trainer.offline import OfflineTrainer


class SFTTrainer(OfflineTrainer):
    """Next-token loss on the assistant turns of `{"messages": [...]}` rows."""

    name = "SFT"
    dataset_cls = SFTDataset

    def build_models(self) -> Policy:
        self.actor = Policy(self.config.actor, self.total_steps)
        self._test_sequences: list[dict[str, torch.Tensor]] | None = None
        return self.actor

    def train_batch(self, sequences: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        return self.actor.train_step(sequences, sft_loss)

    def evaluate(self) -> dict[str, float]:
        """Mean per-token loss over the test set."""
        if self._test_sequences is None:
            self._test_sequences = [self.test_data[i] for i in range(len(self.test_data))]
        return {"loss": self.actor.evaluate(self._test_sequences, sft_loss)["loss"]}


def main() -> None:
    with user_errors_reported():
        SFTTrainer(load_config(sys.argv[1:])).train()
    exit_process(0)


if __name__ == "__main__":
    main()
