"""`ImageInputs`: the images of one sequence as the model takes them, the one form they travel in between the
rollout (a `Turn`'s prompt, a `Trajectory`) and the engines and workers."""

import base64
import io
from dataclasses import dataclass

import torch


@dataclass
class ImageInputs:
    """A sequence's images in the order their pad tokens appear in it: the image processor's patches
    (`pixel_values`, [patches, dim]) and each image's (t, h, w) patch grid (`image_grid_thw`, [images, 3])."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @classmethod
    def of_sample(cls, sample: dict[str, torch.Tensor]) -> "ImageInputs | None":
        """The images of a `build_vision_sample` sample; None where it has none."""
        if "image_grid_thw" not in sample or sample["image_grid_thw"].shape[0] == 0:
            return None
        return cls(sample["pixel_values"], sample["image_grid_thw"])

    @classmethod
    def concat(cls, parts: "list[ImageInputs | None]") -> "ImageInputs | None":
        """The images of sequences joined end to end (a conversation whose later turns add images)."""
        parts = [part for part in parts if part is not None]
        if not parts:
            return None
        return cls(torch.cat([part.pixel_values for part in parts]), torch.cat([part.image_grid_thw for part in parts]))

    def state(self) -> str:
        """As JSON holds it (a checkpoint of paused trajectories): the tensors saved, base64."""
        buffer = io.BytesIO()
        torch.save({"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}, buffer)
        return base64.b64encode(buffer.getvalue()).decode()

    @classmethod
    def from_state(cls, state: str) -> "ImageInputs":
        tensors = torch.load(io.BytesIO(base64.b64decode(state)), weights_only=True)
        return cls(tensors["pixel_values"], tensors["image_grid_thw"])
