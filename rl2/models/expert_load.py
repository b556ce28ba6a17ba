"""How evenly each MoE layer spreads its tokens over its experts (the `router/load_max` metrics).

`ExpertLoad(model)` installs a forward hook on each router module of that model instance (the routers
`rl2.models.routing_replay` knows) that, inside `counting()`, adds the experts the router's output sends each
token to (after routing replay, whose hook runs first when it is installed first) to a `[moe_layers, experts]`
count on the router's device: a scatter-add, no host sync per layer (`torch.bincount` syncs on CUDA to size
its output). Every token the router sees counts, prompt and padding included: the experts compute them all.
The supported families (Qwen3-MoE, OLMoE, gpt-oss, Qwen3-Next, Qwen3.5-MoE) have no expert capacity, so no
token is dropped and every decision is in the count.
"""

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from rl2.models.routing_replay import GATE_WEIGHTS, routers


class ExpertLoad:
    """Routed decisions per (MoE layer, expert), summed over the forwards inside `counting()` since `take()`."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router that expert load knows ({', '.join(GATE_WEIGHTS)})")
        self.num_experts = self.routers[0].num_experts
        self._counting = False
        self._counts: torch.Tensor | None = None
        self._handles = [router.register_forward_hook(functools.partial(self._hook, layer))
                         for layer, router in enumerate(self.routers)]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the forwards run inside (not a checkpointed layer's recomputation in backward, after it)."""
        self._counting = True
        try:
            yield
        finally:
            self._counting = False

    def take(self) -> torch.Tensor:
        """The counts [layers, experts] (int64, on the routers' device; zeros on CPU before any) since the last
        call, which start again from 0."""
        counts = self._counts if self._counts is not None else torch.zeros(self.num_layers, self.num_experts, dtype=torch.long)
        self._counts = None
        return counts

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int, router: nn.Module, args, output) -> None:
        if not self._counting:
            return
        experts = output[2].detach().reshape(-1).long()
        if self._counts is None:
            self._counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.long, device=experts.device)
        self._counts[layer].scatter_add_(0, experts, torch.ones_like(experts))


def load_max(counts: torch.Tensor) -> list[float]:
    """Each layer's busiest expert's share of its routed decisions over the uniform share 1 / experts (1.0: all
    experts equally busy; `experts`: one expert takes every token), from `ExpertLoad` counts [layers, experts];
    0.0 for a layer without decisions."""
    counts = counts.double()
    totals = counts.sum(-1)
    loads = torch.where(totals > 0, counts.max(-1).values * counts.shape[-1] / totals.clamp(min=1), 0.0)
    return loads.tolist()
