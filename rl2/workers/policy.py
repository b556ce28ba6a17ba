"""The policy: a causal LM's per-token log-probs (and entropy) at the sampling temperature."""

import contextlib

import torch
import torch.nn.functional as F

from rl2.config import ModelConfig
from rl2.distributed.process_group import all_reduce_sum
from rl2.errors import ConfigError
from rl2.kernels.logps_head import TokenLogpsHead
from rl2.lora import base_model
from rl2.models.expert_load import ExpertLoad
from rl2.models.routing_replay import UNRECORDED, RoutingReplay, routers, sequence_routes
from rl2.workers.base import ModelWorker, align_to_tokens


def token_logps(
    logits: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log p(token t | tokens before t in its sequence) under softmax(logits / temperature),
    aligned with `input_ids`; 0 at sequence starts. `Policy.forward` computes exactly this
    (`next_token_logps` then `align_to_tokens`), in token chunks or over ranks when configured."""
    next_ids = F.pad(input_ids[0, 1:], (0, 1))
    return align_to_tokens(next_token_logps(scaled_logits(logits[0], temperature), next_ids).unsqueeze(0), position_ids)


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits` in fp32, divided by the sampling temperature."""
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def next_token_logps(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits[t])[next_ids[t]] for every position t of [T, V] logits: [T]."""
    return -F.cross_entropy(logits, next_ids, reduction="none")


class Policy(ModelWorker):
    """A causal LM whose `forward` gives each token's log-prob ("logps") and, on request, the
    entropy of its distribution ("entropy"; with its gradient where an entropy bonus trains on it,
    `entropy_coef` > 0), both at `temperature`: the sampling temperature of the policy that generated
    the tokens.

    With `logps_chunk_size` > 0 the LM head computes them in token chunks and never holds the
    `[T, vocab]` logits (`rl2.kernels.logps_head`). A micro-batch with a `loss_mask` gets them at the
    tokens in it only (0 elsewhere: nothing reads them): the head runs on the positions predicting those.

    A mixture-of-experts policy with `router_replay` other than "off" routes the tokens of sequences that
    carry `routes` ([tokens, moe layers, k] expert ids, `rl2.models.routing_replay`) to those experts
    (`compute_with_routes` records them); trained, it adds the router load-balancing loss ("moe_aux_loss",
    weighted by "moe_aux_loss_coef") to its outputs where that weight is not 0, and counts each MoE layer's
    routed decisions per expert in its training forwards (`expert_counts`)."""

    def __init__(self, config: ModelConfig, total_steps: int, temperature: float = 1.0, trainable: bool = True):
        super().__init__(config, total_steps, trainable, logps_chunk_size=config.logps_chunk_size)
        self.temperature = temperature
        head = getattr(self.model, "lm_head", None)
        self.logps_head = head if isinstance(head, TokenLogpsHead) else None
        self.router_replay = getattr(config, "router_replay", "off")
        moe = bool(routers(self.model))
        self.routing = RoutingReplay(base_model(self.model)) if moe and self.router_replay != "off" else None
        if self.routing is not None and self.sp_group is not None:
            raise ConfigError("actor.router_replay with sp_size > 1 (ring attention) is not supported yet: set sp_size=1")
        # after routing replay's hooks: it counts the experts the tokens go to, replayed or not
        self.expert_load = ExpertLoad(base_model(self.model)) if moe and trainable else None
        coef = getattr(config, "moe_aux_loss_coef", None)
        self.moe_aux_loss_coef = 0.0 if not moe else (
            coef if coef is not None else float(getattr(base_model(self.model).config, "router_aux_loss_coef", 0.0) or 0.0))
        self._aux_loss: torch.Tensor | None = None
        self._router_counts: list = [0, 0]  # changed, replayed decisions since `router_mismatch`

    # ---- routing replay (mixture-of-experts) ---------------------------------------------------

    def pack(self, sequences: list[dict[str, torch.Tensor]], max_tokens: int, group_size: int = 1):
        """`ModelWorker.pack`; sequences' `routes` ([tokens, layers, k]) become each row's [layers, T, k]
        (UNRECORDED for a row's placeholder tokens)."""
        if not sequences or "routes" not in sequences[0]:
            return super().pack(sequences, max_tokens, group_size)
        routes = [seq["routes"] for seq in sequences]
        plan, rows = super().pack([{k: v for k, v in seq.items() if k != "routes"} for seq in sequences],
                                  max_tokens, group_size)
        _, layers, k = routes[0].shape
        for indices, row in zip(plan, rows):
            row_routes = torch.cat([routes[i] for i in indices] or [routes[0][:0]])
            missing = row["input_ids"].shape[1] - row_routes.shape[0]
            row_routes = torch.cat([row_routes, row_routes.new_full((missing, layers, k), UNRECORDED)])
            row["routes"] = row_routes.transpose(0, 1).to(self.device)
        return plan, rows

    @torch.no_grad()
    def compute_with_routes(self, sequences: list[dict[str, torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`compute(sequences, "logps")` and the experts that forward chose for every token of every
        sequence ([tokens, moe layers, k]), on all ranks (R2's recording)."""
        self.model.eval()
        plan, rows = self.pack(sequences, self._inference_max_tokens())
        values, row_routes = [], []
        with self.on_device():
            for row in rows:
                self.routing.record()
                values.append(self.forward(row)["logps"])
                row_routes.append(self.routing.routes().cpu())
        self.routing.off()
        logps = self._per_sequence(sequences, plan, rows, values)
        lengths = [len(seq["input_ids"]) for seq in sequences]
        layers, k = self.routing.num_layers, self.routing.top_k
        local = [torch.zeros(n, layers, k) for n in lengths]  # ids + 1, 0 where another rank routed it
        for indices, row, routes in zip(plan, rows, row_routes):
            for i, piece in zip(indices, sequence_routes(routes[:, :row["cu_seqlens"][-1]], row["cu_seqlens"].cpu())):
                local[i] = piece.transpose(0, 1).float() + 1
        gathered = all_reduce_sum(torch.cat(local)).split(lengths)
        return logps, [(g - 1).to(self.routing.dtype) for g in gathered]

    def router_mismatch(self) -> float | None:
        """The fraction of replayed routing decisions the live routers would have changed, over all ranks'
        forwards since the last call (None without routing replay). A collective: every rank calls it."""
        if self.routing is None:
            return None
        changed, decided = (all_reduce_sum(float(count)) for count in self._router_counts)
        self._router_counts = [0, 0]
        return changed / decided if decided else 0.0

    def expert_counts(self) -> torch.Tensor | None:
        """Each MoE layer's routed decisions per expert ([layers, experts], on CPU) in all ranks' training forwards
        since the last call; None for a dense policy, or without any. A collective: every rank calls it."""
        if self.expert_load is None:
            return None
        counts = all_reduce_sum(self.expert_load.take().to(self.device)).cpu()
        return counts if counts.sum() > 0 else None

    def _replaying(self, micro_batch: dict[str, torch.Tensor]) -> bool:
        """Set the routers for this row: replay its `routes`, or leave them on their own."""
        if self.routing is None or self.routing.mode == "record":
            return False
        if "routes" in micro_batch:
            self.routing.replay(micro_batch["routes"])
            return True
        self.routing.off()
        return False

    def _per_token_outputs(self, **inputs) -> torch.Tensor:
        if self.moe_aux_loss_coef == 0.0 or not torch.is_grad_enabled():
            self._aux_loss = None
            return super()._per_token_outputs(**inputs)
        out = self.model(**inputs, output_router_logits=True)
        self._aux_loss = out.aux_loss
        return out.logits

    def forward(self, micro_batch: dict[str, torch.Tensor], with_entropy: bool = False) -> dict[str, torch.Tensor]:
        replaying = self._replaying(micro_batch)
        training = self.expert_load is not None and torch.is_grad_enabled()
        with self.expert_load.counting() if training else contextlib.nullcontext():
            outputs = self._token_outputs(micro_batch, with_entropy)
        if replaying:
            changed, decided = self.routing.counts()
            self._router_counts = [self._router_counts[0] + changed, self._router_counts[1] + decided]
        if self._aux_loss is not None:
            outputs["moe_aux_loss"] = self._aux_loss
            outputs["moe_aux_loss_coef"] = torch.tensor(self.moe_aux_loss_coef)
            self._aux_loss = None
        return outputs

    def _token_outputs(self, micro_batch: dict[str, torch.Tensor], with_entropy: bool) -> dict[str, torch.Tensor]:
        inputs, next_ids = self._model_inputs(micro_batch)
        scored = self._scored_positions(micro_batch)
        if scored is not None:  # the head (T x vocab) only where a token in the loss is predicted
            inputs["logits_to_keep"], next_ids = scored, next_ids[:, scored]
        entropy_grad = with_entropy and torch.is_grad_enabled() and getattr(self.config, "entropy_coef", 0.0) != 0
        if self.logps_head is not None:
            with self.logps_head.predicting(next_ids[0], self.temperature, with_entropy, entropy_grad):
                per_token = self._per_token_outputs(**inputs)
            outputs = {"logps": per_token[..., 0]}
            if with_entropy:
                outputs["entropy"] = per_token[..., 1] if entropy_grad else per_token[..., 1].detach()
        else:
            logits = scaled_logits(self._per_token_outputs(**inputs)[0], self.temperature)
            outputs = {"logps": next_token_logps(logits, next_ids[0]).unsqueeze(0)}
            if with_entropy:
                with torch.set_grad_enabled(entropy_grad):
                    logps = torch.log_softmax(logits, dim=-1)
                    outputs["entropy"] = -(logps.exp() * logps).sum(-1).unsqueeze(0)
        if scored is not None:
            length = micro_batch["input_ids"].shape[1]
            outputs = {name: value.new_zeros(1, length).index_copy(1, scored, value) for name, value in outputs.items()}
        aligned = {name: self._align(value, micro_batch) for name, value in outputs.items()}
        if scored is None and "loss_mask" in micro_batch:  # sequence parallelism: all computed, the same kept
            aligned = {name: value.where(micro_batch["loss_mask"].bool(), 0.0) for name, value in aligned.items()}
        return aligned

    def _scored_positions(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The positions of a packed row whose next token is in its loss mask (the others' log-probs and
        entropies are never read: 0), or None (all) without a loss mask or with sequence parallelism."""
        if self.sp_group is not None or "loss_mask" not in micro_batch:
            return None
        # position t predicts token t + 1, unless that token starts the next sequence
        predicted = micro_batch["loss_mask"][0, 1:].bool() & (micro_batch["position_ids"][0, 1:] != 0)
        return torch.nonzero(predicted).squeeze(1)
