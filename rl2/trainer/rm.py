"""Reward modelling: `torchrun --nproc_per_node=N -m rl2.trainer.rm critic.model_name=... key=value ...`.

The reward model is trained in the `critic` section (`critic.model_name`, `critic.lr`,
`critic.save_dir`, ...), as in RL2. It reads `{"messages", "chosen", "rejected"}` rows.
"""


import torch

from rl2.algorithms.preference import PAIR, count_pairs, pair_sequences, reward_model_loss, with_pair_weights
from rl2.config import ConfigError
from rl2.data.conversations import PairDataset
from rl2.trainer.base import run_main
from rl2.trainer.offline import OfflineTrainer
from rl2.vision.detect import is_vision_model
from rl2.workers.reward_model import RewardModel


class RMTrainer(OfflineTrainer):
    """A scalar reward per conversation, read at its last token, trained with the Bradley–Terry loss
    −log σ(r_chosen − r_rejected) on preference pairs, a per-pair mean. Evaluation gives the loss,
    accuracy (ties count ½), margin and mean rewards over the test pairs. Checkpoints are Hugging Face
    folders that load with `AutoModelForSequenceClassification` (or `AutoModelForTokenClassification`)."""

    name = "RM"
    dataset_cls = PairDataset
    group_size = PAIR
    main_section = "critic"
    evaluate_before_training = True

    def dataset_class(self) -> type:
        if is_vision_model(self.config.critic.model_name):
            raise ConfigError(f"critic.model_name={self.config.critic.model_name} is a vision-language model: rl2 "
                              f"trains no reward model on those yet (transformers has no sequence- or "
                              f"token-classification class for Qwen-VL models, which rl2's reward-model checkpoints "
                              f"load with)")
        return PairDataset

    def build_models(self) -> RewardModel:
        self.reward_model = RewardModel(self.config.critic, self.total_steps)
        self.loss_fn = reward_model_loss
        return self.reward_model

    def sequences(self, rows: list) -> list[dict[str, torch.Tensor]]:
        return with_pair_weights(pair_sequences(rows))

    def train_batch(self, sequences: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        return {**super().train_batch(sequences), "pairs": count_pairs(sequences)}


def main() -> None:
    run_main(lambda config: RMTrainer(config).train(), "rm")


if __name__ == "__main__":
    main()
