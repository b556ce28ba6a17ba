"""The per-sequence data of an RL step: what each trajectory carries into the packed micro-batches of
the updates, and what the loss functions read from them."""

from typing import TypedDict

import torch
from torch import Tensor


class RLSequence(TypedDict, total=False):
    """One trajectory as 1-D tensors aligned with its tokens (packing concatenates each field).

    Set from the rollout: `input_ids`, `loss_mask`, `engine_logps`. Set by scoring: `old_logps`,
    `ref_logps` (with a reference), `teacher_logps` (distilling), `old_values` and `returns` (with a critic),
    `is_weights` (with a rollout correction, which also takes rejected tokens out of `loss_mask`). Set by the advantage
    computation: `advantages`. Set per minibatch: `loss_weight`, `metric_weight`. With `rollout.trajectory_format=per_turn`
    a trajectory holds one sequence per turn back to back, marked by `turn_starts`; the models see each
    on its own (`split_turns`).
    """

    input_ids: Tensor  # token ids: prompt, responses, tool outputs
    loss_mask: Tensor  # 1.0 on generated tokens of a trajectory that trains, else 0.0
    engine_logps: Tensor  # the engine's log-probs of the generated tokens, 0 elsewhere
    old_logps: Tensor  # the policy's log-probs before this step's updates (or the engine's)
    ref_logps: Tensor  # the reference model's log-probs
    teacher_logps: Tensor  # on-policy distillation: the teacher's log-probs of the sampled tokens
    old_values: Tensor  # the critic's values before this step's updates
    returns: Tensor  # GAE's value targets
    advantages: Tensor  # per-token advantages, 0 outside the loss mask
    is_weights: Tensor  # with a rollout correction: each token's importance weight (detached)
    loss_weight: Tensor  # per-token weights of the minibatch loss (`rl2.algorithms.losses.loss_weights`)
    metric_weight: Tensor  # loss_weight scaled to sum to 1 over the minibatch: the weights of its metrics
    turn_starts: Tensor  # per turn: 1.0 where a turn's own sequence begins, else 0.0
    # Routing replay (actor.router_replay, a mixture-of-experts policy): each token's experts per MoE layer,
    # [tokens, moe layers, k] int8/int16 (`rl2.models.routing_replay`; UNRECORDED where none was recorded).
    routes: Tensor
    # A vision-language model's trajectory (not per token; packing concatenates them in the row's order): the
    # images its image-pad tokens stand for (`rl2.vision.image_inputs.ImageInputs`); with several sequences, the
    # k-th holds images first .. first + count − 1, turn_images[k] = (first, count) (`split_turns`).
    pixel_values: Tensor  # [patches, dim]
    image_grid_thw: Tensor  # [images, 3]
    turn_images: Tensor  # [turns, 2]


# Fields of a per-turn sequence that are not split by its turns' lengths.
NOT_PER_TOKEN = ("turn_starts", "turn_images", "pixel_values", "image_grid_thw")


def turn_start_mask(turn_starts: list[int], length: int) -> Tensor:
    """`RLSequence.turn_starts` of a trajectory whose turns' sequences begin at `turn_starts`."""
    mask = torch.zeros(length)
    mask[turn_starts] = 1.0
    return mask


def split_turns(sequence: RLSequence) -> list[RLSequence]:
    """A per-turn trajectory's sequence → one sequence per turn (every per-token field split alike, `turn_starts`
    dropped; each turn with the images it holds, `turn_images`); any other sequence as it is."""
    if "turn_starts" not in sequence:
        return [sequence]
    starts = sequence["turn_starts"].nonzero().flatten().tolist()
    bounds = [*(starts if starts and starts[0] == 0 else [0, *starts]), len(sequence["turn_starts"])]
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    fields = {key: value.split(lengths) for key, value in sequence.items() if key not in NOT_PER_TOKEN}
    turns = [{key: pieces[i] for key, pieces in fields.items()} for i in range(len(lengths))]
    if "turn_images" in sequence:
        grid, pixels = sequence["image_grid_thw"], sequence["pixel_values"]
        for turn, (first, count) in zip(turns, sequence["turn_images"].tolist()):
            if count:
                start = int(grid[:first].prod(-1).sum())  # each image's patches: t x h x w
                turn["pixel_values"] = pixels[start : start + int(grid[first : first + count].prod(-1).sum())]
                turn["image_grid_thw"] = grid[first : first + count]
    return turns


def per_turn_sequences(sequences: list[RLSequence]) -> list[RLSequence]:
    """Every turn of every sequence as a sequence of its own (`split_turns`)."""
    return [turn for sequence in sequences for turn in split_turns(sequence)]


def computed_per_turn(compute, sequences: list[RLSequence], output: str) -> list[Tensor]:
    """`compute(sequences, output)` (a model's per-token outputs) with each turn of a per-turn trajectory
    seen on its own, joined back into one tensor per trajectory."""
    return joined_per_turn(sequences, compute(per_turn_sequences(sequences), output))


def joined_per_turn(sequences: list[RLSequence], per_turn: list[Tensor]) -> list[Tensor]:
    """Per-token values of `per_turn_sequences(sequences)` joined back into one tensor per sequence."""
    values = iter(per_turn)
    return [torch.cat([next(values) for _ in split_turns(sequence)]) for sequence in sequences]
