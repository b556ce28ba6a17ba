"""Direct preference optimisation: `torchrun --nproc_per_node=N -m rl2.trainer.dpo key=value ...`.

The policy (`actor.*`) learns from `{"messages", "chosen", "rejected"}` rows against a frozen
reference, a second sharded copy of `actor.model_name` (`ref_actor.offload_model` keeps it in CPU
memory between uses). `actor.beta` and `actor.label_smoothing` shape the loss.
"""

import dataclasses
import sys
import time

import torch

from rl2.workers.policy import Policy
from rl2.config import Config, ConfigError, load_config
from rl2.data.conversations import PairDataset
from rl2.distributed.process_group import exit_process
from rl2.algorithms.preference import PAIR, DPOLoss, count_pairs, pair_sequences
from rl2.trainer.base import require_pair_budget, user_errors_reported
from rl2.trainer.offline import OfflineTrainer

class DPOTrainer(OfflineTrainer):
    """Sigmoid DPO: raise the policy's log-ratio to the reference on chosen responses over rejected
    ones. Logs the implicit rewards β·(log π − log π_ref) of both, their margin and accuracy."""

    name = "DPO"
    dataset_cls = PairDataset
    evaluate_before_training = True

    def check_config(self, config: Config) -> None:
        if not config.actor.beta > 0:
            raise ConfigError(f"actor.beta must be > 0, got {config.actor.beta}")
        if not 0 <= config.actor.label_smoothing < 0.5:
            raise ConfigError(
                f"actor.label_smoothing must be in [0, 0.5), got {config.actor.label_smoothing} "
                "(at 0.5 the loss no longer prefers either response)"
            )
        require_pair_budget(config, "actor")

    def build_models(self) -> Policy:
        config = self.config
        self.actor = Policy(config.actor, self.total_steps)
        # The reference is always the starting model (actor.model_name), also when resuming.
        reference_config = dataclasses.replace(config.actor, offload_model=config.ref_actor.offload_model)
        self.reference = Policy(reference_config, 0, trainable=False)
        self.loss_fn = DPOLoss(config.actor.beta, config.actor.label_smoothing)
        self._test_sequences: list[dict[str, torch.Tensor]] | None = None
        return self.actor

    def sequences(self, rows: list) -> list[dict[str, torch.Tensor]]:
        return pair_sequences(rows)

    def with_reference_logps(self, sequences: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """`sequences` with the reference's per-token log-probs ("ref_logps"), computed once, no grad."""
        ref_logps = self.reference.compute(sequences)
        return [{**seq, "ref_logps": logps} for seq, logps in zip(sequences, ref_logps)]

    def train_batch(self, sequences: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        start = time.perf_counter()
        sequences = self.with_reference_logps(sequences)
        reference_time = time.perf_counter() - start
        pairs = count_pairs(sequences)
        metrics = self.actor.train_step(sequences, self.loss_fn, loss_total=max(pairs, 1), group_size=PAIR)
        metrics["pairs"] = pairs
        metrics["time/reference"] = reference_time
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Loss, implicit-reward accuracy (ties count ½), margin and rewards over the test pairs
        (the reference's log-probs of the test set are computed once)."""
        if self._test_sequences is None:
            items = [self.test_data[i] for i in range(len(self.test_data))]
            self._test_sequences = self.with_reference_logps(pair_sequences(items))
        pairs = count_pairs(self._test_sequences)
        metrics = self.actor.evaluate(self._test_sequences, self.loss_fn, loss_total=max(pairs, 1), group_size=PAIR)
        metrics.pop("loss_tokens")
        return metrics


def main() -> None:
    with user_errors_reported():
        DPOTrainer(load_config(sys.argv[1:])).train()
    exit_process(0)


if __name__ == "__main__":
    main()
