"""Routes (R3 routing replay) from an engine that reports each token's experts for every decoder layer.

SGLang (`return_routed_experts`) and vLLM (`enable_return_routed_experts`) hand back, per finished request, the
top-k experts of each token they fed through the model, `[tokens, decoder layers, k]` (the layers without experts
hold filler): SGLang as int32 base64-encoded, vLLM as an array. rl2's routes
(`Generation.routes`, `rl2.models.routing_replay`) hold the MoE layers alone, in model order, in the smallest
integer type: `RouteLayout` says which decoder layers those are, read from the model's structure (built on the
meta device: nothing is allocated).
"""

import base64
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl2.models.routing_replay import GATE_WEIGHTS, route_dtype

_DTYPES = {"int32": np.int32, "int16": np.int16, "uint16": np.uint16, "int8": np.int8, "uint8": np.uint8}


@dataclass(frozen=True)
class RouteLayout:
    """Where a model's MoE layers sit among its decoder layers, and the shape and type of its routes."""

    decoder_layers: int
    moe_layers: tuple[int, ...]  # the decoder layer of each MoE router, in model order
    top_k: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model_path: str) -> "RouteLayout | None":
        """The layout of the model at `model_path`; None for a model without MoE routers routing replay knows."""
        config = AutoConfig.from_pretrained(model_path)
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM transformers builds (e.g. a vision-language model)
            return None
        found = [(name, module) for name, module in model.named_modules() if type(module).__name__ in GATE_WEIGHTS]
        if not found:
            return None
        layers = tuple(int(next(part for part in name.split(".") if part.isdigit())) for name, _ in found)
        router = found[0][1]
        return cls(config.get_text_config().num_hidden_layers, layers, router.top_k, route_dtype(router.num_experts))

    def decode(self, payload: str, dtype: str = "int32") -> torch.Tensor:
        """rl2's routes [tokens, moe layers, k] from an engine's base64 `payload` of [tokens, decoder layers, k]
        expert ids of type `dtype`."""
        return self.moe_routes(np.frombuffer(base64.b64decode(payload), dtype=_DTYPES[dtype]))

    def moe_routes(self, values: np.ndarray) -> torch.Tensor:
        """rl2's routes [tokens, moe layers, k] from an engine's expert ids [tokens, decoder layers, k] (or flat)."""
        values = np.asarray(values)
        per_token = self.decoder_layers * self.top_k
        if values.size % per_token:
            raise ValueError(f"routed experts of {values.size} ids are not whole tokens of {self.decoder_layers} "
                             f"layers x top-{self.top_k}")
        routes = torch.from_numpy(values.astype(np.int64).reshape(-1, self.decoder_layers, self.top_k))
        return routes[:, list(self.moe_layers)].to(self.dtype)

    def encode(self, routes: torch.Tensor) -> str:
        """The engine's payload (int32 [tokens, decoder layers, k], 0 in the layers without experts) for rl2's
        `routes`: what a stand-in engine hands back."""
        full = torch.zeros(routes.shape[0], self.decoder_layers, self.top_k, dtype=torch.int32)
        full[:, list(self.moe_layers)] = routes.to(torch.int32)
        return base64.b64encode(full.numpy().tobytes()).decode()
