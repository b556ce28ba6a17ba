"""Direct preference optimisation: `torchrun --nproc_per_node=N -m rl2.trainer.dpo key=value ...`.

The policy (`actor.*`) learns from `{"messages", "chosen", "rejected"}` rows against a frozen
reference, a second sharded copy of `actor.model_name` (`ref_actor.offload_model` keeps it in CPU
memory between uses). `actor.beta` and `actor.label_smoothing` shape the loss.
"""

import dataclasses
import time

import torch

from rl2.algorithms.preference import PAIR, DPOLoss, count_pairs, pair_sequences, with_pair_weights
from rl2.data.conversations import PairDataset
from rl2.lora import AdaptersOff
from rl2.trainer.base import run_main
from rl2.trainer.offline import OfflineTrainer
from rl2.workers.policy import Policy


class DPOTrainer(OfflineTrainer):
    """Sigmoid DPO: raise the policy's log-ratio to the reference on chosen responses over rejected
    ones, a per-pair mean. Logs the implicit rewards β·(log π − log π_ref) of both, their margin and
    accuracy (ties count ½); the reference's log-probs of the test set are computed once."""

    name = "DPO"
    dataset_cls = PairDataset
    group_size = PAIR
    evaluate_before_training = True

    def dataset_class(self) -> type:
        return self.reading_images(PairDataset)

    def build_models(self) -> Policy:
        config = self.config
        self.actor = Policy(config.actor, self.total_steps)
        # The reference is always the starting model (actor.model_name), also when resuming; with LoRA,
        # the actor with its adapters disabled.
        if config.actor.lora.rank > 0:
            self.reference = AdaptersOff(self.actor)
        else:
            reference_config = dataclasses.replace(config.actor, offload_model=config.ref_actor.offload_model)
            self.reference = Policy(reference_config, 0, trainable=False)
        self.loss_fn = DPOLoss(config.actor.beta, config.actor.label_smoothing)
        return self.actor

    def sequences(self, rows: list) -> list[dict[str, torch.Tensor]]:
        return with_pair_weights(pair_sequences(rows))

    def with_inputs(self, sequences: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """`sequences` with the reference's per-token log-probs ("ref_logps"), computed once, no grad."""
        ref_logps = self.reference.compute(sequences)
        return [{**seq, "ref_logps": logps} for seq, logps in zip(sequences, ref_logps)]

    def train_batch(self, sequences: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        start = time.perf_counter()
        sequences = self.with_inputs(sequences)
        reference_time = time.perf_counter() - start
        metrics = self.actor.train_step(sequences, self.loss_fn, self.group_size)
        return {**metrics, "pairs": count_pairs(sequences), "time/reference": reference_time}


def main() -> None:
    run_main(lambda config: DPOTrainer(config).train(), "dpo")


if __name__ == "__main__":
    main()
