"""The critic: a value per token from the causal LM's body with a scalar head."""

import torch
from torch import nn
from transformers import AutoModelForTokenClassification

from rl2.config import ModelConfig
from rl2.workers.base import ModelWorker


class ValueHead(nn.Module):
    """A token-classification head (`score`: weight and bias under the same names) whose output is a
    tensor of its own. `nn.Linear` on [1, T, H] returns a view of its 2-D result; as the output of the
    FSDP root that view draws torch's warning that an in-place op on it would skip the pre-backward
    hook. Nothing here writes to it in place; the output is still made fresh, so the warning is gone."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden @ self.weight.t()
        return out + self.bias if self.bias is not None else out


def install_value_head(model: nn.Module) -> None:
    if not isinstance(getattr(model, "score", None), nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear `score` head for per-token values")
    model.score = ValueHead(model.score)


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
            prepare=install_value_head,
            lora_modules_to_save=["score"],  # with LoRA the value head still trains whole
        )

    def forward(self, micro_batch: dict[str, torch.Tensor], with_entropy: bool = False) -> dict[str, torch.Tensor]:
        scores = self._per_token_outputs(**self._model_inputs(micro_batch)[0])
        return {"values": self._align(scores.float().squeeze(-1), micro_batch)}
