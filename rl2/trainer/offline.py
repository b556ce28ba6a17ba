"""The loop shared by the trainers that step through a fixed dataset: SFT, reward modelling, DPO."""

import logging
import os
import time

import torch
from tqdm import tqdm

from rl2.checkpoint import checkpoint_dir
from rl2.config import Config
from rl2.config_checks import check_config
from rl2.data.image_rows import ImageInputs
from rl2.data.prefetch import BatchPrefetcher
from rl2.data.rows import DataError
from rl2.data.sampler import BatchSampler
from rl2.distributed.process_group import is_rank0
from rl2.trainer.base import Trainer
from rl2.workers.base import LossFn, ModelWorker
from rl2.workers.optim import resume_schedule


class OfflineTrainer(Trainer):
    """One optimizer step per batch of `data.batch_size` rows, in a seeded, resumable order.

    A step: the next rows from the sampler → `sequences(rows)` (with their loss weights) → `train_batch`
    (`with_inputs`, then one optimizer step of `loss_fn`) → test metrics from `evaluate` at test steps
    (the same loss and metrics over the whole test set, logged as `test/<name>`) → metrics.jsonl →
    checkpoint at save steps. Subclasses set `name`, `dataset_cls` and `group_size` (and
    `main_section` when the trained model is not the actor), build their models in `build_models`
    (returning the model the optimizer steps), set `loss_fn` there, and define `sequences`.
    """

    name: str
    dataset_cls: type
    group_size = 1  # sequences kept together in one packed row (a preference pair: 2)
    # Log the test metrics once before the first step (step 0), the start of the test curve.
    evaluate_before_training = False
    image_inputs: ImageInputs | None = None  # a vision-language model's (`reading_images`)

    def __init__(self, config: Config):
        check_config(config, self.name.lower())
        super().__init__(config)
        self.train_data, self.test_data = self.load_datasets(self.dataset_class(), config.data.max_length)
        # Rows with images are built (decoded, processed) on a data thread, a batch ahead of the step.
        self.prefetcher = BatchPrefetcher(self.train_data) if getattr(self.train_data, "images", None) else None
        self.sampler = BatchSampler(len(self.train_data), config.data.batch_size, config.data.shuffle,
                                    config.trainer.seed, source=f"training rows of {config.data.path}")
        self.total_steps = config.trainer.total_steps or config.trainer.n_epochs * self.sampler.batches_per_epoch
        self.loss_fn: LossFn | None = None
        self.trained: ModelWorker = self.build_models()
        self._test_sequences: list[dict[str, torch.Tensor]] | None = None
        self.resume()
        # The subclass's logger, e.g. "rl2.trainer.sft" (not __name__, "__main__" under `python -m`).
        logging.getLogger(f"rl2.trainer.{self.name.lower()}").info(
            f"{self.name}: {len(self.train_data)} training rows, {len(self.test_data) if self.test_data else 0} "
            f"test rows, {self.total_steps} steps of {config.data.batch_size} rows{self.sampler.left_over_note()}"
        )

    # ---- what subclasses define --------------------------------------------------------------

    def dataset_class(self) -> type:
        """The dataset class of this run's rows (`dataset_cls`, unless the model calls for another)."""
        return self.dataset_cls

    def reading_images(self, dataset_cls: type) -> type:
        """`dataset_cls`, reading the rows' images where the trained model (the actor, the reward model) is a
        vision-language model (`image_inputs`)."""
        self.image_inputs = ImageInputs.for_model(self.main_config.model_name, self.config.data)
        return dataset_cls if self.image_inputs is None else dataset_cls.reading_images(self.image_inputs)

    def save(self, step: int) -> str:
        if self.image_inputs is not None and is_rank0():  # the checkpoint loads as a model that reads images
            path = checkpoint_dir(self.main_config.save_dir, step)
            os.makedirs(path, exist_ok=True)
            self.image_inputs.image_processor.save_pretrained(path)
        return super().save(step)

    def build_models(self) -> ModelWorker:
        """Build the models and set `loss_fn`; return the model being trained."""
        raise NotImplementedError

    def sequences(self, rows: list) -> list[dict[str, torch.Tensor]]:
        """The sequences (dicts of 1-D tensors, with their `loss_weight`) that a batch of dataset
        items trains on."""
        raise NotImplementedError

    def with_inputs(self, sequences: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """`sequences` with whatever else `loss_fn` reads (e.g. a reference model's log-probs)."""
        return sequences

    # ---- a step, an evaluation -----------------------------------------------------------------

    def train_batch(self, sequences: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """One optimizer step on `sequences`; returns its metrics."""
        return self.trained.train_step(self.with_inputs(sequences), self.loss_fn, self.group_size)

    def evaluate(self) -> dict[str, float]:
        """`loss_fn`'s loss and metrics over the whole test set (its sequences made once)."""
        if self._test_sequences is None:
            items = [self.test_data[i] for i in range(len(self.test_data))]
            self._test_sequences = self.with_inputs(self.sequences(items))
        metrics = self.trained.evaluate(self._test_sequences, self.loss_fn, self.group_size)
        metrics.pop("loss_tokens")
        return metrics

    # ---- checkpointing -------------------------------------------------------------------------

    def checkpointed_models(self) -> dict:
        return {self.main_section: (self.trained.model, self.trained.optimizer)}

    def extra_state(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "scheduler": self.trained.scheduler.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        resume_schedule(self.trained.scheduler, state["scheduler"])

    # ---- the loop ------------------------------------------------------------------------------

    def require_trained_tokens(self, sequences: list[dict[str, torch.Tensor]], truncated: int) -> None:
        """A batch without a single token in its loss trains nothing (its step would only decay the
        weights): a `DataError` naming the likely cause, before the optimizer steps. Every rank holds
        the whole batch, so every rank raises."""
        if any(bool(seq["loss_mask"].any()) for seq in sequences):
            return
        max_length = self.config.data.max_length
        cause = (f"{truncated} of them were cut at data.max_length={max_length} tokens before any reply began; "
                 f"raise data.max_length" if truncated else "their rows have no assistant reply to train on")
        raise DataError(f"{self.name} step {self.step}: the batch's {len(sequences)} sequences have no token to "
                        f"train on ({cause}); checkpoints saved so far are kept")

    def test_metrics(self) -> dict[str, float]:
        if self.prefetcher is not None:
            self.prefetcher.wait()  # the tokenizer is not shared between threads
        return {f"test/{key}": value for key, value in self.evaluate().items()}

    def train(self) -> None:
        """Train to `total_steps` (testing and saving on their schedules), then close the run (`close`)."""
        testing = self.test_data is not None
        if testing and self.evaluate_before_training and self.step == 0 and self.config.trainer.test_freq is not None:
            self.metrics.log(self.test_metrics(), 0)
        # closed also on an error, so that an error's line starts on a line of its own
        with tqdm(total=self.total_steps, initial=self.step, desc=self.name, disable=not is_rank0()) as progress:
            while self.step < self.total_steps:
                self.step += 1
                start = time.perf_counter()
                items, truncated = self.batch_items(self.sampler.next_batch())
                sequences = self.sequences(items)
                self.require_trained_tokens(sequences, truncated)
                metrics = self.train_batch(sequences)
                metrics["truncated"] = truncated
                metrics["step_time"] = time.perf_counter() - start
                metrics["tokens_per_second"] = sum(len(s["input_ids"]) for s in sequences) / metrics["step_time"]
                if testing and self.is_test_step(self.step):
                    metrics.update(self.test_metrics())
                self.metrics.log(metrics, self.step)
                progress.update(1)
                progress.set_postfix(loss=f"{metrics['loss']:.4f}")
                if self.should_save(self.step):
                    self.save(self.step)
        self.close()

    def batch_items(self, indices: list[int]) -> tuple[list, int]:
        """The training rows' items at `indices` and how many were truncated; with a prefetcher, built on its
        thread, which then starts on the next batch's (unless this is the last step's)."""
        if self.prefetcher is None:
            truncated_before = self.train_data.num_truncated
            items = [self.train_data[i] for i in indices]
            return items, self.train_data.num_truncated - truncated_before
        result = self.prefetcher.items(indices)
        if self.step < self.total_steps:
            self.prefetcher.prefetch(self.sampler.peek_batch())
        return result

    def release(self) -> None:
        if getattr(self, "prefetcher", None) is not None:
            self.prefetcher.close()
        super().release()
