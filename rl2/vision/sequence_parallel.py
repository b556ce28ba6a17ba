"""Sequence parallelism for a Qwen-VL model: ring attention after the embeddings are merged.

Every rank of a sequence-parallel group runs the model's own forward on the whole packed row: the vision
tower over all the row's images, their features scattered into the image-pad positions of the text
embeddings (and, for Qwen3-VL, the DeepStack features and their positions). The text model then runs on
the rank's ZigZag share of the row (`rl2.distributed.ring_attention`): a forward pre-hook on it splits the
merged embeddings, the 4-row position ids and the DeepStack inputs the way `zigzag_split` splits tokens.

Gradients: the split's backward gives each rank the gradient of its own tokens' embeddings only (zeros
elsewhere), so the vision tower, run on every rank, gets each rank's share of its gradient; summed over the
group (FSDP's reduction) that is the whole gradient, once, as for the text embeddings of a text model.
"""

import functools

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from rl2.distributed.ring_attention import zigzag_cu_seqlens, zigzag_position_ids, zigzag_split
from rl2.lora import base_model


def split_text_model_inputs(model: nn.Module, sp_rank: int, sp_size: int) -> RemovableHandle:
    """Make the text model of `model` (a Qwen-VL model, or a peft model around one) run on rank `sp_rank`'s
    ZigZag share of the packed row it is given. The model is called on the whole row as
    `rl2.vision.forward.packed_vision_inputs` gives it (the whole row's `cu_seq_lens_q`); the text model's
    attention must be ring attention over the group. Returns the hook's handle."""
    text_model = getattr(getattr(base_model(model), "model", None), "language_model", None)
    if text_model is None:
        raise ValueError(f"{type(base_model(model)).__name__} has no text model (model.language_model)")
    share = functools.partial(_zigzag_share, sp_rank=sp_rank, sp_size=sp_size)
    return text_model.register_forward_pre_hook(share, with_kwargs=True)


def _zigzag_share(module: nn.Module, args: tuple, kwargs: dict, sp_rank: int, sp_size: int) -> tuple[tuple, dict]:
    """The text model's keyword arguments for the whole row → those for this rank's share of it."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    embeds, positions = kwargs.get("inputs_embeds"), kwargs.get("position_ids")
    if args or cu_seqlens is None or embeds is None or positions is None or positions.shape[:2] != (4, 1):
        raise ValueError("a sequence-parallel Qwen-VL text model takes keyword arguments only: the whole row's "
                         "inputs_embeds, 4-row position_ids [4, 1, T] and cu_seq_lens_q (packed_vision_inputs)")
    split = functools.partial(zigzag_split, cu_seqlens=cu_seqlens, sp_rank=sp_rank, sp_size=sp_size)
    local_cu = zigzag_cu_seqlens(cu_seqlens, sp_size)
    longest = int((local_cu[1:] - local_cu[:-1]).max())
    # [4, 1, T]: the text positions, as a text model's under sequence parallelism, then the mRoPE rows,
    # split along the tokens like the embeddings (as [1, T, 3] for zigzag_split).
    text = zigzag_position_ids(cu_seqlens, sp_rank, sp_size).to(positions)
    mrope = split(positions[-3:].permute(1, 2, 0)).permute(2, 0, 1)
    kwargs = {
        **kwargs,
        "inputs_embeds": split(embeds),
        "position_ids": torch.cat([text.unsqueeze(0), mrope]),
        "cu_seq_lens_q": local_cu,
        "cu_seq_lens_k": local_cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }
    masks, deepstack = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
    if masks is not None and deepstack is not None:  # Qwen3-VL: features [visual tokens, D] per fed layer
        local_masks = split(masks, pad_value=False)
        kwargs["visual_pos_masks"] = local_masks
        kwargs["deepstack_visual_embeds"] = [_local_features(features, masks, local_masks, split) for features in deepstack]
    return (), kwargs


def _local_features(features: torch.Tensor, masks: torch.Tensor, local_masks: torch.Tensor, split) -> torch.Tensor:
    """The rows of `features` (one per True of `masks` [1, T], in order) of this rank's visual tokens, in the
    order of its share: scattered over the whole row, split, gathered back at `local_masks`."""
    row = features.new_zeros(*masks.shape, features.shape[-1]).masked_scatter(masks[..., None], features)
    return split(row)[local_masks]
