"""The per-sequence data of an RL step: what each trajectory carries into the packed micro-batches of
the updates, and what the loss functions read from them."""

from typing import TypedDict

from torch import Tensor


class RLSequence(TypedDict, total=False):
    """One trajectory as 1-D tensors aligned with its tokens (packing concatenates each field).

    Set from the rollout: `input_ids`, `loss_mask`, `engine_logps`. Set by scoring: `old_logps`,
    `ref_logps` (with a reference), `old_values` and `returns` (with a critic), `is_weights` (with a rollout
    correction, which also takes rejected tokens out of `loss_mask`). Set by the advantage
    computation: `advantages`. Set per minibatch: `loss_weight`.
    """

    input_ids: Tensor  # token ids: prompt, responses, tool outputs
    loss_mask: Tensor  # 1.0 on generated tokens of a trajectory that trains, else 0.0
    engine_logps: Tensor  # the engine's log-probs of the generated tokens, 0 elsewhere
    old_logps: Tensor  # the policy's log-probs before this step's updates (or the engine's)
    ref_logps: Tensor  # the reference model's log-probs
    old_values: Tensor  # the critic's values before this step's updates
    returns: Tensor  # GAE's value targets
    advantages: Tensor  # per-token advantages, 0 outside the loss mask
    is_weights: Tensor  # with a rollout correction: each token's importance weight (detached)
    loss_weight: Tensor  # per-token weights of the minibatch loss, summing to 1 over the minibatch
