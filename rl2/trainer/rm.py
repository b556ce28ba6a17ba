"""Reward modelling: `torchrun --nproc_per_node=N -m rl2.trainer.rm critic.model_name=... key=value ...`.

The reward model is trained in the `critic` section (`critic.model_name`, `critic.lr`,
`critic.save_dir`, ...), as in RL2. It reads `{"messages", "chosen", "rejected"}` rows.
"""


import torch

from rl2.algorithms.preference import PAIR, count_pairs, pair_sequences, reward_model_loss, with_pair_weights
from rl2.data.conversations import PairDataset
from rl2.trainer.base import run_main
from rl2.trainer.offline import OfflineTrainer
from rl2.workers.reward_model import RewardModel


class RMTrainer(OfflineTrainer):
    """A scalar reward per conversation, read at its last token, trained with the Bradley–Terry loss
    −log σ(r_chosen − r_rejected) on preference pairs, a per-pair mean. Evaluation gives the loss,
    accuracy (ties count ½), margin and mean rewards over the test pairs. Checkpoints are Hugging Face
    folders that load with `AutoModelForSequenceClassification` (or `AutoModelForTokenClassification`); a
    vision-language reward model (Qwen2.5-VL, Qwen3-VL) trains on pairs whose prompts hold images and its
    folders load with `rl2.vision.value_model`'s classes (e.g. `Qwen2_5_VLForSequenceClassification`)."""

    name = "RM"
    dataset_cls = PairDataset
    group_size = PAIR
    main_section = "critic"
    evaluate_before_training = True

    def dataset_class(self) -> type:
        return self.reading_images(PairDataset)

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
