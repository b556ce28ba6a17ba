"""A vision-language model's image processing as rl2 applies it (`rl2.vision.inputs.build_vision_sample`): the
image processor with the run's `data.min_pixels` / `data.max_pixels`, and each image's pad-token count; for the
places that process images one request at a time (the OpenAI server)."""

from dataclasses import dataclass
from typing import Any

from PIL import Image

from rl2.vision.image_inputs import ImageInputs


@dataclass
class ImageProcessing:
    """`image_processor` (a Qwen-VL one) resizing images within `min_pixels` / `max_pixels` (None: its own)."""

    image_processor: Any
    min_pixels: int | None = None
    max_pixels: int | None = None

    @classmethod
    def from_pretrained(cls, model_name: str, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> "ImageProcessing":
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(model_name), min_pixels, max_pixels)

    def __call__(self, images: list[Image.Image]) -> ImageInputs:
        """`images`' patches and grids, as `build_vision_sample` computes them."""
        size = dict(self.image_processor.size)  # shortest_edge / longest_edge: the min / max pixels of an image
        if self.min_pixels is not None:
            size["shortest_edge"] = self.min_pixels
        if self.max_pixels is not None:
            size["longest_edge"] = self.max_pixels
        processed = self.image_processor(images=images, return_tensors="pt", size=size)
        return ImageInputs(processed["pixel_values"], processed["image_grid_thw"])

    def pad_counts(self, images: ImageInputs) -> list[int]:
        """How many image-pad tokens each image takes (one per merged patch)."""
        return (images.image_grid_thw.prod(-1) // self.image_processor.merge_size**2).tolist()
