"""Reward modelling: `torchrun --nproc_per_node=N -m rl2.trainer.rm critic.model_name=... key=value ...`.

The reward model is trained in the `critic` section (`critic.model_name`, `critic.lr`,
`critic.save_dir`, ...), as in RL2. It reads `{"messages", "chosen", "rejected"}` rows.
"""

import sys

import torch

from rl2.workers.policy import Policy
from rl2.workers.reward_model import RewardModel
from rl2.config import Config, ConfigError, load_config
from rl2.data.conversations import PairDataset
from rl2.distributed.process_group import exit_process
from rl2.algorithms.preference import PAIR, count_pairs, pair_sequences, reward_model_loss
from rl2.trainer.base import require_pair_budget, user_errors_reported
from rl2.trainer.offline import OfflineTrainer

class RMTrainer(OfflineTrainer):
    """A scalar reward per conversation, read at its last token, trained with the Bradley–Terry loss
    −log σ(r_chosen − r_rejected) on preference pairs. Checkpoints are Hugging Face folders that load
    with `AutoModelForSequenceClassification` (or `AutoModelForTokenClassification`)."""

    name = "RM"
    dataset_cls = PairDataset
    main_section = "critic"
    evaluate_before_training = True

    def check_config(self, config: Config) -> None:
        if config.critic.model_name is None:
            hint = (
                f"; actor.model_name={config.actor.model_name} is not used here: did you mean critic.model_name?"
                if config.actor.model_name is not None
                else ""
            )
            raise ConfigError(
                "critic.model_name is required: rl2.trainer.rm trains the reward model in the critic section "
                f"(critic.model_name, critic.lr, critic.save_dir, ...), as RL2 does{hint}"
            )
        require_pair_budget(config, "critic")

    def build_models(self) -> Policy:
        self.reward_model = RewardModel(self.config.critic, self.total_steps)
        self._test_sequences: list[dict[str, torch.Tensor]] | None = None
        return self.reward_model

    def sequences(self, rows: list) -> list[dict[str, torch.Tensor]]:
        return pair_sequences(rows)

    def train_batch(self, sequences: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        pairs = count_pairs(sequences)
        metrics = self.reward_model.train_step(sequences, reward_model_loss, loss_total=max(pairs, 1), group_size=PAIR)
        metrics["pairs"] = pairs
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Loss, accuracy (ties count ½), margin and mean rewards over the test pairs."""
        if self._test_sequences is None:
            self._test_sequences = pair_sequences([self.test_data[i] for i in range(len(self.test_data))])
        pairs = count_pairs(self._test_sequences)
        metrics = self.reward_model.evaluate(
            self._test_sequences, reward_model_loss, loss_total=max(pairs, 1), group_size=PAIR
        )
        metrics.pop("loss_tokens")
        return metrics


def main() -> None:
    with user_errors_reported():
        RMTrainer(load_config(sys.argv[1:])).train()
    exit_process(0)


if __name__ == "__main__":
    main()
