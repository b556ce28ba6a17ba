"""A one-token placeholder sequence holding the smallest image, for packed rows that have no image.

Under FSDP every rank must run the vision tower in every micro-batch (its blocks are sharded units whose
all-gathers have to line up across ranks). A row without an image gets this sequence appended: its own
sequence in the row (so no other sample's logits change), every per-token value 0 but its token, the image
pad (so it adds nothing to a loss weighted by the loss mask, and exactly 0 to every gradient), and one
merged patch of a blank image.
"""

import torch

from rl2.vision.positions import IMAGE_KEYS, VISION_POSITIONS


def placeholder_image_sample(config, like: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """A sample of one image-pad token and a blank `merge x merge`-patch image, for a model of `config`
    (a Qwen-VL config), with its mRoPE positions (all 0), so no model is needed to pack it. Its per-token
    keys are `like`'s, in `like`'s order (pack_micro_batch wants the same keys), all 0 but `input_ids`
    and `mm_token_type_ids`; without `like`: `input_ids`, `loss_mask`, `mm_token_type_ids`."""
    vision = config.vision_config
    merge, patch = vision.spatial_merge_size, vision.patch_size
    dim = vision.in_channels * vision.temporal_patch_size * patch * patch
    like = like or {"input_ids": torch.zeros(1, dtype=torch.long), "loss_mask": torch.zeros(1, dtype=torch.long),
                    "mm_token_type_ids": torch.zeros(1, dtype=torch.long)}
    sample = {key: torch.zeros(1, dtype=value.dtype) for key, value in like.items()
              if key not in IMAGE_KEYS and key != VISION_POSITIONS}
    sample["input_ids"] = torch.tensor([config.image_token_id])
    sample["mm_token_type_ids"] = torch.ones(1, dtype=torch.long)
    sample[VISION_POSITIONS] = torch.zeros(3, 1, dtype=torch.long)
    sample["pixel_values"] = torch.zeros(merge * merge, dim)
    sample["image_grid_thw"] = torch.tensor([[1, merge, merge]])
    return sample


def with_placeholder_image(samples: list[dict[str, torch.Tensor]], config) -> list[dict[str, torch.Tensor]]:
    """`samples`, plus the placeholder sample at the end when none of them has an image. The caller drops
    the placeholder's outputs (the row's last sequence) where one was added."""
    if any("pixel_values" in sample for sample in samples):
        return samples
    return [*samples, placeholder_image_sample(config, like=samples[0] if samples else None)]
