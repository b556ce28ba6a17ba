"""The reward model: a score per token from the causal LM's body with a scalar head, read at a
sequence's last token."""

import torch
from transformers import AutoModelForSequenceClassification

from rl2.config import ModelConfig
from rl2.lora import base_model
from rl2.workers.base import ModelWorker


class RewardModel(ModelWorker):
    """A reward model: the causal LM's body with a scalar head (sequence classification, one label).

    `forward` gives the head's score at every token ("scores", [1, T]); a sequence's reward is the
    score of its last token, which is what `AutoModelForSequenceClassification` returns for the
    sequence alone. The exported folder loads with that class, and with
    `AutoModelForTokenClassification` (its config says no head bias and no dropout), which gives the
    score of every token.
    """

    def __init__(self, config: ModelConfig, total_steps: int):
        super().__init__(
            config,
            total_steps,
            model_cls=AutoModelForSequenceClassification,
            config_overrides={"num_labels": 1, "classifier_dropout": 0.0, "token_classification_bias": False},
            lora_modules_to_save=["score"],  # with LoRA the head still trains whole
        )
        head = getattr(base_model(self.model), "score", None)
        trained = head.modules_to_save["default"] if hasattr(head, "modules_to_save") else head  # peft's copy
        if not isinstance(trained, torch.nn.Linear):
            raise ValueError(f"{type(self.model).__name__} has no linear `score` head to read per-token rewards from")
        # The sequence-classification forward keeps only each row's last score; the head sees them all.
        self._head_output: torch.Tensor | None = None
        head.register_forward_hook(self._keep_head_output)

    def _keep_head_output(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self._head_output = output

    def _per_token_outputs(self, **inputs) -> torch.Tensor:
        self.model(**inputs)
        scores, self._head_output = self._head_output, None
        return scores

    def forward(self, micro_batch: dict[str, torch.Tensor], with_entropy: bool = False) -> dict[str, torch.Tensor]:
        scores = self._per_token_outputs(**self._model_inputs(micro_batch)[0]).float().squeeze(-1)
        return {"scores": self._gather(scores, micro_batch)}
