"""Preference pairs: chosen and rejected sequences side by side in packed rows, and the pairwise
losses of reward modelling (Bradley–Terry) and DPO.

A batch of pairs is one list of sequences, `[chosen_0, rejected_0, chosen_1, rejected_1, ...]`;
packed with `group_size=PAIR` (`Policy.pack`), each pair stays adjacent and in order in one packed
row, so a loss function sees whole pairs: the even sequences of a row are chosen, the odd ones
rejected. Loss functions return sums over the pairs of a row weighted by `pair_weights`, which the
trainer sets to 1 / the pairs of the whole batch (`with_pair_weights`), so the loss is a per-pair mean
whatever the packing.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PAIR = 2  # sequences per pair: chosen, then rejected


def pair_sequences(items: list[dict[str, dict[str, torch.Tensor]]]) -> list[dict[str, torch.Tensor]]:
    """`PairDataset` items as one list of sequences: chosen_0, rejected_0, chosen_1, ..."""
    return [item[field] for item in items for field in ("chosen", "rejected")]


def count_pairs(sequences: list[dict[str, torch.Tensor]]) -> int:
    """Pairs that count in the loss: both responses keep at least one loss token (a prompt longer
    than `data.max_length` truncates both responses away, leaving nothing to compare)."""
    return sum(
        int(bool(chosen["loss_mask"].any()) and bool(rejected["loss_mask"].any()))
        for chosen, rejected in zip(sequences[0::PAIR], sequences[1::PAIR])
    )


def sequence_sums(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-sequence sums [n] of a packed row's per-token values ([1, T] or [T])."""
    values = values.reshape(-1)
    bounds = cu_seqlens.to(values.device).long()
    index = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=values.device), bounds[1:] - bounds[:-1])
    return torch.zeros(len(bounds) - 1, dtype=values.dtype, device=values.device).index_add(0, index, values)


def last_token_values(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each sequence's value at its last token [n], from a packed row's per-token values."""
    return values.reshape(-1)[cu_seqlens.to(values.device).long()[1:] - 1]


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair reward-model loss: −log σ(r_chosen − r_rejected)."""
    return -F.logsigmoid(chosen - rejected)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair sigmoid DPO loss (Rafailov et al. 2023) from response log-probabilities.

    With h = β·[(log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r))], the loss is
    −(1 − ε)·log σ(h) − ε·log σ(−h), where ε (`label_smoothing`) is the assumed probability that the
    preference is flipped (conservative DPO). Returns the loss and the implicit rewards
    β·(log π − log π_ref) of the chosen and rejected responses (detached).
    """
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    logits = beta * (chosen_ratio - rejected_ratio)
    loss = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def preference_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per pair: 1 when the chosen response scores higher, 0 when lower, ½ on a tie (so a model
    that cannot tell the two apart, e.g. DPO's policy before its first step, scores 0.5)."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


def pair_metric_sums(chosen: torch.Tensor, rejected: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over pairs of accuracy, margin and both rewards, weighted by the pairs' `weight`."""
    chosen, rejected = chosen.detach(), rejected.detach()
    return {
        "accuracy": (preference_accuracy(chosen, rejected) * weight).sum(),
        "margin": ((chosen - rejected) * weight).sum(),
        "reward/chosen": (chosen * weight).sum(),
        "reward/rejected": (rejected * weight).sum(),
    }


def with_pair_weights(sequences: list[dict[str, torch.Tensor]], pair_weight: float | None = None) -> list[dict]:
    """`sequences` (chosen, rejected, ...) with their `loss_weight`: each pair that counts (see
    `count_pairs`) weighs `pair_weight`, by default 1 / the pairs that count, so the weights sum to 1
    over the batch. A pair's weight sits on its chosen response's first loss token (exact when
    summed back by `pair_weights`); every other token weighs 0."""
    if pair_weight is None:
        pair_weight = 1.0 / max(count_pairs(sequences), 1)
    weighted = []
    for chosen, rejected in zip(sequences[0::PAIR], sequences[1::PAIR]):
        weight = torch.zeros(len(chosen["loss_mask"]))
        if chosen["loss_mask"].any() and rejected["loss_mask"].any():
            weight[int(chosen["loss_mask"].nonzero()[0])] = pair_weight
        weighted += [{**chosen, "loss_weight": weight}, {**rejected, "loss_weight": torch.zeros(len(rejected["loss_mask"]))}]
    return weighted


def pair_weights(micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight of each pair of a packed row (see `with_pair_weights`): 0 for pairs that do not
    count and for the placeholder pair of a rank with no data."""
    return sequence_sums(micro_batch["loss_weight"].float(), micro_batch["cu_seqlens"])[0::PAIR]


def reward_model_loss(
    outputs: dict[str, torch.Tensor], micro_batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Bradley–Terry loss summed over the pairs of a packed row, each sequence's reward being the
    score of its last token; with accuracy, margin and reward sums."""
    rewards = last_token_values(outputs["scores"], micro_batch["cu_seqlens"])
    chosen, rejected = rewards[0::PAIR], rewards[1::PAIR]
    weight = pair_weights(micro_batch)
    return (bradley_terry_loss(chosen, rejected) * weight).sum(), pair_metric_sums(chosen, rejected, weight)


@dataclass(frozen=True)
class DPOLoss:
    """DPO's loss function for packed rows holding the policy's "logps" (outputs) and the reference's
    "ref_logps" (micro-batch) per token; a response's log-probability sums its loss-masked tokens."""

    beta: float
    label_smoothing: float = 0.0

    def __call__(
        self, outputs: dict[str, torch.Tensor], micro_batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask, cu_seqlens = micro_batch["loss_mask"], micro_batch["cu_seqlens"]
        logps = sequence_sums(outputs["logps"] * mask, cu_seqlens)
        ref_logps = sequence_sums(micro_batch["ref_logps"] * mask, cu_seqlens)
        loss, chosen_rewards, rejected_rewards = dpo_loss(
            logps[0::PAIR], logps[1::PAIR], ref_logps[0::PAIR], ref_logps[1::PAIR], self.beta, self.label_smoothing
        )
        weight = pair_weights(micro_batch)
        metrics = pair_metric_sums(chosen_rewards, rejected_rewards, weight)
        metrics["logps/chosen"] = (logps[0::PAIR].detach() * weight).sum()
        metrics["logps/rejected"] = (logps[1::PAIR].detach() * weight).sum()
        return (loss * weight).sum(), metrics
