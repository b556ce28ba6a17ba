"""One decode forward over the first R slots, replayed from a captured CUDA graph on CUDA.

A decode step of a small model is launch-bound: hundreds of small kernels for a few
microseconds of work each. A CUDA graph replays them all with one launch. Graphs need fixed
shapes and addresses, so inputs go through static buffers, the KV slots never move, and a graph
is captured per (rows, kv_length) bucket: rows rounded up to a power of two, kv_length to a
power of two from `MIN_KV_BUCKET`, both capped at the cache's size. On CPU the same step runs
eagerly at the exact sizes.
"""

import contextlib
import logging

import torch
from torch import nn

from rl2.engines.kv_slots import DecodePlan, KVSlots, no_masks

logger = logging.getLogger(__name__)

MIN_KV_BUCKET = 256


def bucket(size: int, limit: int, smallest: int = 1) -> int:
    """The power of two (at least `smallest`) that holds `size`, capped at `limit`."""
    rounded = smallest
    while rounded < size:
        rounded *= 2
    return min(rounded, limit)


class DecodeStep:
    """`step(input_ids [R], write_positions [R], kv_length, slots=None)` → last-position logits [R, V].

    Row r is slot r, or slot `slots[r]` when given (eager steps only: the running slots alone, when
    finished ones lie among them); a row whose write position is the cache's scratch column is idle
    (its output is meaningless but finite). With `use_graphs` the returned logits live in a static
    buffer, overwritten by the next step.

    With `mrope` (a Qwen-VL model) a token at cache position p is rotated by p + `rope_deltas[slot]` in
    its three mRoPE rows: the engine sets a slot's delta when it prefills the slot's prompt.

    Where the cache keeps routes (`KVSlots.keep_routes`), each row's experts are written beside its key, in
    the captured graphs too.
    """

    def __init__(self, model: nn.Module, kv: KVSlots, use_graphs: bool, mrope: bool = False):
        self.model, self.kv, self.use_graphs, self.mrope = model, kv, use_graphs, mrope
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.static_ids = torch.zeros(kv.num_slots, dtype=torch.long, device=kv.device)
        self.static_positions = torch.zeros(kv.num_slots, dtype=torch.long, device=kv.device)
        self.rope_deltas = torch.zeros(kv.num_slots, dtype=torch.long, device=kv.device)  # read in place by graphs
        self.no_masks = no_masks(mrope, kv.device)

    def reset(self) -> None:
        """Drop the captured graphs (the cache was reallocated or released, or the model moved)."""
        self.graphs.clear()
        self.pool = None

    def sizes(self, rows: int, kv_length: int) -> tuple[int, int]:
        """The (rows, kv_length) a step for `rows` rows reading `kv_length` positions runs at."""
        if not self.use_graphs:
            return rows, kv_length
        return bucket(rows, self.kv.num_slots), bucket(kv_length, self.kv.capacity, MIN_KV_BUCKET)

    def __call__(self, input_ids: torch.Tensor, write_positions: torch.Tensor, kv_length: int,
                 slots: torch.Tensor | None = None) -> torch.Tensor:
        rows = input_ids.shape[0]
        if not self.use_graphs:
            return self.forward(input_ids, write_positions, kv_length, slots)
        if slots is not None:
            raise ValueError("a decode step over chosen slots runs eagerly: captured graphs read the first R slots")
        self.static_ids[:rows].copy_(input_ids)
        self.static_positions[:rows].copy_(write_positions)
        key = (rows, kv_length)
        if key not in self.graphs:
            self.graphs[key] = self._capture(rows, kv_length)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits

    def forward(self, input_ids: torch.Tensor, write_positions: torch.Tensor, kv_length: int,
                slots: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(kv_length, device=input_ids.device)
        mask = (positions[None, :] <= write_positions[:, None])[:, None, None, :]
        plan = DecodePlan(write_positions=write_positions, mask=mask, kv_length=kv_length, slots=slots)
        position_ids = write_positions[:, None]
        if self.mrope:  # [4, R, 1]: the cache positions, then the three mRoPE rows
            rows = input_ids.shape[0]
            rotated = position_ids + (self.rope_deltas[:rows] if slots is None else self.rope_deltas[slots])[:, None]
            position_ids = torch.stack([position_ids, rotated, rotated, rotated])
        routed = contextlib.nullcontext()
        if self.kv.route_shape is not None:  # routes kept (R3): row r's token goes where its key goes
            rows = torch.arange(input_ids.shape[0], device=input_ids.device) if slots is None else slots
            routed = self.kv.routing_to(rows, write_positions)
        with routed:
            return self.model(
                input_ids=input_ids[:, None],
                position_ids=position_ids,
                attention_mask=self.no_masks,
                kv_slots=self.kv,
                kv_plan=plan,
                use_cache=False,
            ).logits[:, -1]

    def _capture(self, rows: int, kv_length: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, positions = self.static_ids[:rows], self.static_positions[:rows]
        # Warm-up on a side stream, as torch.cuda.graphs asks, so lazy initialisation is not captured. Its rows
        # are idle (the scratch column): a step runs once, at the replay, and a hybrid model's linear-attention
        # states (`linear_attention_slots`) must not advance at the warm-ups too.
        idle = torch.full_like(positions, self.kv.capacity)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(ids, idle, kv_length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(ids, positions, kv_length)
        logger.debug(f"captured a decode graph for {rows} rows, {kv_length} positions")
        return graph, logits
