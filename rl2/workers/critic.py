"""The critic: a value per token from the causal LM's body with a scalar head."""

import torch
from transformers import AutoModelForTokenClassification

from rl2.config import ModelConfig
from rl2.workers.base import ModelWorker


class Critic(ModelWorker):
    """A value model: the causal LM's body with a scalar head per token (token classification).

    `values[t]` is the value of the state before token t (the prefix that token t was drawn
    from), aligned with the policy's log-probs; 0 at sequence starts.
    """

    def __init__(self, config: ModelConfig, total_steps: int):
        # No dropout: values must be the same function of the input on every rank and in every pass.
        super().__init__(
            config,
            total_steps,
            model_cls=AutoModelForTokenClassification,
            config_overrides={"num_labels": 1, "classifier_dropout": 0.0},
        )

    def forward(self, micro_batch: dict[str, torch.Tensor], with_entropy: bool = False) -> dict[str, torch.Tensor]:
        scores = self._per_token_outputs(**self._model_inputs(micro_batch)[0])
        return {"values": self._align(scores.float().squeeze(-1), micro_batch)}
