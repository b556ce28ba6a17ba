"""The policy: a causal LM's per-token log-probs (and entropy) at the sampling temperature."""

import torch
import torch.nn.functional as F

from rl2.config import ModelConfig
from rl2.kernels.logps_head import TokenLogpsHead
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
    tokens in it only (0 elsewhere: nothing reads them): the head runs on the positions predicting those."""

    def __init__(self, config: ModelConfig, total_steps: int, temperature: float = 1.0, trainable: bool = True):
        super().__init__(config, total_steps, trainable, logps_chunk_size=config.logps_chunk_size)
        self.temperature = temperature
        head = getattr(self.model, "lm_head", None)
        self.logps_head = head if isinstance(head, TokenLogpsHead) else None

    def forward(self, micro_batch: dict[str, torch.Tensor], with_entropy: bool = False) -> dict[str, torch.Tensor]:
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
