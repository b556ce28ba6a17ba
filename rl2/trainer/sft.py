"""Supervised fine-tuning: `torchrun --nproc_per_node=N -m rl2.trainer.sft key=value ...`."""

import logging
import sys
import time

import torch
from tqdm import tqdm

from rl2.actor import Actor, sft_loss
from rl2.config import Config, load_config
from rl2.data import SFTDataset
from rl2.distributed import exit_process, is_rank0
from rl2.sampler import BatchSampler
from rl2.trainer.base import Trainer, require, user_errors_reported

# Not __name__: under `python -m rl2.trainer.sft` that is "__main__", outside the rl2 logger.
logger = logging.getLogger("rl2.trainer.sft")


class SFTTrainer(Trainer):
    """Next-token loss on the assistant turns of `{"messages": [...]}` rows."""

    def __init__(self, config: Config):
        require(config, "data.path", "actor.model_name")
        super().__init__(config)
        self.train_data, self.test_data = self.load_datasets(SFTDataset, config.data.max_length)
        self.sampler = BatchSampler(
            len(self.train_data), config.data.batch_size, config.data.shuffle, config.trainer.seed
        )
        self.total_steps = config.trainer.total_steps or config.trainer.n_epochs * self.sampler.batches_per_epoch
        self.actor = Actor(config.actor, self.total_steps)
        self._test_sequences: list[dict[str, torch.Tensor]] | None = None
        self.resume()
        logger.info(
            f"SFT: {len(self.train_data)} training rows, {len(self.test_data) if self.test_data else 0} test rows, "
            f"{self.total_steps} steps of {config.data.batch_size} rows"
        )

    def checkpointed_models(self) -> dict:
        return {"actor": (self.actor.model, self.actor.optimizer)}

    def extra_state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "scheduler": self.actor.scheduler.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.actor.scheduler.load_state_dict(state["scheduler"])

    def evaluate(self) -> float:
        """Mean per-token loss over the test set."""
        if self._test_sequences is None:
            self._test_sequences = [self.test_data[i] for i in range(len(self.test_data))]
        return self.actor.evaluate(self._test_sequences, sft_loss)["loss"]

    def train(self) -> None:
        progress = tqdm(total=self.total_steps, initial=self.step, desc="SFT", disable=not is_rank0())
        while self.step < self.total_steps:
            self.step += 1
            start = time.perf_counter()
            truncated_before = self.train_data.num_truncated
            sequences = [self.train_data[i] for i in self.sampler.next_batch()]
            metrics = self.actor.train_step(sequences, sft_loss)
            metrics["truncated"] = self.train_data.num_truncated - truncated_before
            metrics["step_time"] = time.perf_counter() - start
            metrics["tokens_per_second"] = sum(len(s["input_ids"]) for s in sequences) / metrics["step_time"]
            if self.test_data is not None and self.is_test_step(self.step):
                metrics["test/loss"] = self.evaluate()
            self.metrics.log(metrics, self.step)
            progress.update(1)
            progress.set_postfix(loss=f"{metrics['loss']:.4f}")
            if self.should_save(self.step):
                self.save(self.step)
        progress.close()
        self.metrics.finish()


def main() -> None:
    with user_errors_reported():
        SFTTrainer(load_config(sys.argv[1:])).train()
    exit_process(0)


if __name__ == "__main__":
    main()
