"""Deterministic, resumable batches of dataset indices: a fresh seeded shuffle every epoch."""

import torch

from rl2.config import ConfigError


class BatchSampler:
    """Yields global batches of `batch_size` indices, the same on every rank.

    The last incomplete batch of an epoch is dropped so every step sees a full batch. The
    position (epoch, batch in epoch) is the whole state, so a resumed run continues with exactly
    the batches an uninterrupted run would have seen.
    """

    def __init__(self, num_rows: int, batch_size: int, shuffle: bool = True, seed: int = 0,
                 key: str = "data.batch_size", source: str = "rows of the dataset"):
        if batch_size > num_rows:
            raise ConfigError(f"{key}={batch_size} is larger than the {num_rows} {source}: no batch fills; "
                              f"lower {key}")
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # rows of this epoch's order already handed out

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.batch_size

    def left_over_note(self) -> str:
        """"" when the batches use every row; else a note on the rows each epoch leaves out."""
        left = self.num_rows % self.batch_size
        if not left:
            return ""
        which = "other rows each epoch: the order is reshuffled" if self.shuffle else "the last rows of the file"
        return f"; {left} rows an epoch do not fill a batch and are left out ({which})"

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def next_batch(self) -> list[int]:
        """The next batch's indices; rolls over to a new epoch when one ends."""
        return self.next_rows(self.batch_size)

    def peek_batch(self) -> list[int]:
        """The indices `next_batch` will return, without moving on."""
        epoch, position = self.epoch, self.position
        try:
            return self.next_batch()
        finally:
            self.epoch, self.position = epoch, position

    def next_rows(self, n: int) -> list[int]:
        """The next `n` indices (at most the dataset's rows) of this epoch's order; when fewer than `n`
        are left, a new epoch starts and the rest are left out (as an incomplete batch is)."""
        if not 0 <= n <= self.num_rows:
            raise ValueError(f"cannot draw {n} rows from {self.num_rows}")
        if self.position + n > self.num_rows:
            self.epoch += 1
            self.position = 0
        start, self.position = self.position, self.position + n
        return self._order(self.epoch)[start : start + n]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        # checkpoints before the position was kept count whole batches
        self.position = state["position"] if "position" in state else state["batch_in_epoch"] * self.batch_size
