"""A dataset's items for the next batch built on a background thread while the current step trains
(vision-language rows: decoding and processing their images takes a while)."""

from concurrent.futures import Future, ThreadPoolExecutor

import torch


class BatchPrefetcher:
    """`items(indices)` returns the dataset's items at `indices` and how many of them were truncated
    (the dataset's `num_truncated` grew by), built by `prefetch(indices)` beforehand on one background
    thread where the indices match, else now. Only this object touches the dataset meanwhile; an error in
    building an item (a `DataError`) is raised by the `items` call that wanted it."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl2-data")
        self.pending: tuple[list[int], Future] | None = None

    def _build(self, indices: list[int]) -> tuple[list[dict[str, torch.Tensor]], int]:
        before = self.dataset.num_truncated
        items = [self.dataset[i] for i in indices]
        return items, self.dataset.num_truncated - before

    def prefetch(self, indices: list[int]) -> None:
        """Start building the items at `indices` (after any build under way)."""
        self.wait()
        self.pending = (list(indices), self.executor.submit(self._build, list(indices)))

    def items(self, indices: list[int]) -> tuple[list[dict[str, torch.Tensor]], int]:
        pending, self.pending = self.pending, None
        if pending is not None:
            result = pending[1].result()  # waited for even when unused: one thread at a time in the dataset
            if pending[0] == list(indices):
                return result
        return self._build(indices)

    def wait(self) -> None:
        """Wait until no build is under way (its result kept, an error in it kept for `items`)."""
        if self.pending is not None:
            self.pending[1].exception()

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
