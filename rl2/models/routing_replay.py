"""Record and replay of mixture-of-experts routing (R2 / R3 routing replay, arXiv 2510.11370).

An inference engine and the training forward route some tokens to different experts (kernels, batch
shapes and precision differ), so the trained policy is not the one that sampled. Routing replay records
each token's top-k experts per MoE layer in one forward (R3: the rollout engine's; R2: the trainer's own
old-log-prob forward) and makes later forwards use them. The gate weights are still computed from the live
router logits at the recorded experts, as the model's own router computes them from its top-k, so the
router keeps its gradient.

`RoutingReplay(model)` installs a forward hook on each router module of that model instance (nothing is
patched at class level) and removes them on `close()` or on leaving its `with` block. Routes are
`[moe_layers, tokens, k]` integer tensors (int8 up to 128 experts, else int16), layers in model order,
tokens in the order the routers see them (a packed row's tokens, or a batch flattened row by row).
"""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def _softmax_then_pick(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE, OLMoE, Qwen3-Next: softmax over all experts, the chosen ones' probabilities, renormalised
    to sum to 1 when the router's `norm_topk_prob` says so (Qwen3-30B-A3B: yes; OLMoE: no)."""
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, experts)
    if router.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _softmax_then_pick_normalised(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Qwen3.5-MoE: as Qwen3-MoE, always renormalised."""
    weights = F.softmax(logits, dtype=torch.float, dim=-1).gather(-1, experts)
    return (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)


def _pick_then_softmax(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """gpt-oss: a softmax over the chosen experts' logits only."""
    chosen = logits.gather(-1, experts)
    return F.softmax(chosen, dim=1, dtype=chosen.dtype)


# Router class -> its gate weights from (router, logits [tokens, experts], chosen experts [tokens, k]).
# Each router here returns (logits, gate weights, chosen experts) from its forward.
GATE_WEIGHTS: dict[str, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_then_pick,
    "OlmoeTopKRouter": _softmax_then_pick,
    "Qwen3NextTopKRouter": _softmax_then_pick,
    "Qwen3_5MoeTopKRouter": _softmax_then_pick_normalised,
    "GptOssTopKRouter": _pick_then_softmax,
}

# In replayed routes: a token with no recorded experts (e.g. the last sampled token, which no engine forward
# routed), routed by the live router.
UNRECORDED = -1


def router_class(module: nn.Module) -> str:
    """The name of a module's class, as GATE_WEIGHTS knows routers: a router that peft adapts (LoRA on its
    weight, `target_modules=all-linear`) is parametrized during each forward, its class then torch's
    `Parametrized<Class>`."""
    return type(module).__name__.removeprefix("Parametrized")


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE router modules of `model` that routing replay knows, in model order."""
    return [module for module in model.modules() if router_class(module) in GATE_WEIGHTS]


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type holding expert ids 0 .. num_experts - 1 (int8 or int16)."""
    if num_experts <= 128:
        return torch.int8
    if num_experts <= 2**15:
        return torch.int16
    raise ValueError(f"{num_experts} experts do not fit int16 routes")


def routing_mismatch(live: torch.Tensor, recorded: torch.Tensor) -> float:
    """The fraction of recorded decisions (layer, token, slot) whose expert is not among the live top-k of
    that token and layer: what the live router would have chosen differently. Slot order does not count
    (the same experts in another order give the same output); UNRECORDED tokens are not decisions."""
    if live.shape != recorded.shape:
        raise ValueError(f"live routes {tuple(live.shape)} and recorded routes {tuple(recorded.shape)} differ in shape")
    recorded = recorded.long()
    kept = (recorded.unsqueeze(-1) == live.long().unsqueeze(-2).to(recorded.device)).any(-1)
    decided = ~(recorded == UNRECORDED).any(-1, keepdim=True).expand_as(kept)
    return 1.0 - kept[decided].float().mean().item() if decided.any() else 0.0


def sequence_routes(routes: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """A packed row's routes [layers, tokens, k] -> each sequence's [layers, length, k] (views)."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != routes.shape[1]:
        raise ValueError(f"cu_seqlens {bounds} do not describe routes of {routes.shape[1]} tokens")
    return [routes[:, start:end] for start, end in zip(bounds[:-1], bounds[1:])]


def packed_routes(routes: list[torch.Tensor]) -> torch.Tensor:
    """Sequences' routes [layers, length, k] -> their packed row's [layers, tokens, k], in that order (as
    `rl2.distributed.packing.pack_micro_batch` packs their tokens)."""
    return torch.cat(routes, dim=1)


class RoutingReplay:
    """Routing record and replay installed on one model's routers (see the module docstring).

    Modes: "off" (the routers as they are), "record" (`routes()` then gives every token's top-k experts
    per layer, over all forwards since `record()`), "replay" (`replay(routes)`: the routers use those
    experts until the mode changes; `mismatch()` says how many decisions the live routers would have
    changed). In "replay" mode `routes()` gives the live routers' own choices. Recording appends per
    forward: record without gradients (a rollout, an old-log-prob forward), as a checkpointed training
    forward recomputes its layers in backward.
    """

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router that routing replay knows "
                             f"({', '.join(GATE_WEIGHTS)})")
        self.top_k = self.routers[0].top_k
        self.num_experts = self.routers[0].num_experts
        self.dtype = route_dtype(self.num_experts)
        self._gate_weights = [GATE_WEIGHTS[router_class(router)] for router in self.routers]
        self.mode = "off"
        self._live: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._replayed: torch.Tensor | None = None
        self._mismatched = self._decisions = 0
        self._sink: Callable[[int, torch.Tensor], None] | None = None
        self._handles = [router.register_forward_hook(functools.partial(self._hook, layer))
                         for layer, router in enumerate(self.routers)]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def record(self, sink: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """Record from the next forward on (dropping what was recorded before). With a `sink`, each router's
        choice goes to `sink(layer, experts [tokens, k])` instead of being kept (`routes()` then gives none):
        a captured CUDA graph replays what the sink does with them, where a kept list would miss them."""
        self._set_mode("record")
        self._sink = sink

    def replay(self, routes: torch.Tensor) -> None:
        """Route the next forwards' tokens to `routes` [layers, tokens, k] (as `routes()` gives them; a token
        whose ids are UNRECORDED goes where the live router sends it). They stay set until the mode
        changes: a checkpointed forward recomputes its layers with them in backward."""
        if routes.dim() != 3 or routes.shape[0] != self.num_layers or routes.shape[2] != self.top_k:
            raise ValueError(f"routes must be [{self.num_layers} layers, tokens, {self.top_k}], "
                             f"got {tuple(routes.shape)}")
        self._set_mode("replay")
        self._replayed = routes

    def off(self) -> None:
        """Leave the routers as they are."""
        self._set_mode("off")

    def routes(self) -> torch.Tensor:
        """The top-k experts the live routers chose since the mode was last set: [layers, tokens, k]."""
        if any(len(calls) != len(self._live[0]) for calls in self._live):
            raise RuntimeError("the MoE layers ran different numbers of forwards: a forward was interrupted")
        if not self._live[0]:
            return torch.zeros(self.num_layers, 0, self.top_k, dtype=self.dtype)
        return torch.stack([torch.cat(calls) for calls in self._live])

    def mismatch(self) -> float:
        """The fraction of replayed decisions the live routers would have changed, over the forwards since
        `replay` (0.0 before any)."""
        decisions = int(self._decisions)
        return float(self._mismatched) / decisions if decisions else 0.0

    def counts(self) -> tuple[torch.Tensor | int, torch.Tensor | int]:
        """(changed decisions, replayed decisions) since `replay`, as tensors (no host sync) or 0."""
        return self._mismatched, self._decisions

    def close(self) -> None:
        """Remove the hooks: the routers are as before."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._set_mode("off")

    def __enter__(self) -> "RoutingReplay":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _set_mode(self, mode: str) -> None:
        self.mode = mode
        self._live = [[] for _ in self.routers]
        self._replayed = None
        self._mismatched = self._decisions = 0
        self._sink = None

    def _hook(self, layer: int, router: nn.Module, args, output):
        if self.mode == "off":
            return None
        logits, weights, experts = output
        if self._sink is not None:
            self._sink(layer, experts.detach())
            return None
        self._live[layer].append(experts.detach().to(self.dtype))
        if self.mode == "record":
            return None
        replayed = self._replayed[layer].to(device=experts.device, dtype=torch.long)
        if replayed.shape != experts.shape:
            raise ValueError(f"routes for MoE layer {layer} cover {replayed.shape[0]} tokens; this forward "
                             f"routes {experts.shape[0]}")
        unrecorded = (replayed == UNRECORDED).any(-1, keepdim=True)
        replayed = torch.where(unrecorded, experts, replayed)
        changed = ~(replayed.unsqueeze(-1) == experts.unsqueeze(-2)).any(-1)
        # tensors, not numbers: no host sync per layer
        self._mismatched = self._mismatched + changed.sum()
        self._decisions = self._decisions + (~unrecorded).sum() * self.top_k
        return logits, self._gate_weights[layer](router, logits, replayed), replayed
