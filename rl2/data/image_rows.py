"""What turns rows with images into a vision-language model's samples: its image processor and mRoPE
position function, read once from the model's folder (its config only: no weights)."""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoImageProcessor

from rl2.config import DataConfig
from rl2.errors import DataError
from rl2.vision.detect import is_vision_config
from rl2.vision.positions import VISION_POSITIONS, mrope_position_ids, rope_index_from_config

IMAGE_ROW = "image_row"  # an RL prompt's key: its row's messages and images, processed by the rank that rolls it out


def image_row(row: dict[str, Any], index: int, messages_key: str, image_key: str, where: str) -> dict:
    """What `rl2.rollout.images.RolloutImages.prepare` reads of a dataset row (`build_vision_sample`'s arguments)."""
    return {"row": row, "index": index, "messages_key": messages_key, "image_key": image_key, "where": where}


def check_image_file(value: Any, where: str) -> None:
    """A DataError naming `where` when `value` is an image path (not a data URI or URL) that is not a file;
    nothing is read."""
    if isinstance(value, dict):
        value = value.get("path") if value.get("bytes") is None else None
    if isinstance(value, str) and not value.startswith(("data:", "http://", "https://")):
        path = value.removeprefix("file://")
        if not os.path.isfile(path):
            raise DataError(f"{where}: image file not found: {path}")


@dataclass(frozen=True)
class ImageInputs:
    """A vision-language model's image processor (the PIL one: no torchvision), its `get_rope_index`
    (from the config, on the meta device) and the pixel bounds of `data.min_pixels` / `data.max_pixels`."""

    image_processor: Any
    rope_index: Callable
    min_pixels: int | None = None
    max_pixels: int | None = None

    @classmethod
    def for_model(cls, model_name: str, data: DataConfig) -> "ImageInputs | None":
        """The image inputs of `model_name`; None for a text-only model."""
        config = AutoConfig.from_pretrained(model_name)
        if not is_vision_config(config):
            return None
        processor = AutoImageProcessor.from_pretrained(model_name, backend="pil")
        return cls(processor, rope_index_from_config(config), data.min_pixels, data.max_pixels)

    def positioned(self, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`sample` with its own mRoPE positions (`vision_position_ids` [3, L]), so packing needs no model."""
        return {**sample, VISION_POSITIONS: mrope_position_ids(self.rope_index, sample)}
