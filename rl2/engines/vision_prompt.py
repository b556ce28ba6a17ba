"""A vision-language prompt as the `hf` engine handles it: where its images' pad tokens lie, the token
keys its KV slot is indexed by (each image's pads keyed by the image itself, so prefixes are shared only
where the images are equal), the images of a suffix, and its mRoPE positions with their decode delta."""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl2.vision.image_inputs import ImageInputs


@dataclass
class VisionPrompt:
    """A prompt's images and the token span [start, end) each one's pad tokens fill, in order."""

    images: ImageInputs | None
    spans: list[tuple[int, int]]
    patches: list[int]  # pixel_values rows of each image

    @classmethod
    def of(cls, prompt: list[int], images: ImageInputs | None, pad_id: int, merge_size: int) -> "VisionPrompt":
        """The spans of `images` in `prompt`; a ValueError when the pad tokens do not match the images."""
        counts = [] if images is None else (images.image_grid_thw.prod(-1) // merge_size**2).tolist()
        pads = [position for position, token in enumerate(prompt) if token == pad_id]
        if len(pads) != sum(counts):
            raise ValueError(f"the prompt has {len(pads)} image pad tokens but its {len(counts)} image(s) "
                             f"need {sum(counts)}")
        spans, at = [], 0
        for count in counts:
            start, end = pads[at], pads[at + count - 1] + 1
            if end - start != count:
                raise ValueError(f"an image's {count} pad tokens are not contiguous in the prompt (from {start})")
            spans.append((start, end))
            at += count
        patches = [] if images is None else images.image_grid_thw.prod(-1).tolist()
        return cls(images, spans, patches)

    def keys(self, prompt: list[int]) -> list[int]:
        """`prompt` with each image's pad tokens replaced by a negative key of the image's pixels: equal
        keys, equal images (so a cached prefix is reused only where the images are the same)."""
        if not self.spans:
            return list(prompt)
        keys, first = list(prompt), 0
        for (start, end), patches, grid in zip(self.spans, self.patches, self.images.image_grid_thw.tolist()):
            pixels = self.images.pixel_values[first : first + patches]
            digest = hashlib.blake2b(pixels.contiguous().cpu().numpy().tobytes() + repr(grid).encode(), digest_size=7)
            keys[start:end] = [-1 - int.from_bytes(digest.digest(), "little")] * (end - start)
            first += patches
        return keys

    def shareable(self, length: int) -> int:
        """`length` cut back to the start of an image it would end inside (an image is computed whole)."""
        for start, end in self.spans:
            if start < length < end:
                return start
        return length

    def images_from(self, position: int) -> ImageInputs | None:
        """The images whose pad tokens lie at or after `position` (`shareable` positions only)."""
        first, patch_start = None, 0
        for k, ((start, _), patches) in enumerate(zip(self.spans, self.patches)):
            if start >= position:
                first = k
                break
            patch_start += patches
        if first is None:
            return None
        return ImageInputs(self.images.pixel_values[patch_start:], self.images.image_grid_thw[first:])


def mrope_positions(rope_index: Callable, prompt: list[int], vision: VisionPrompt, pad_id: int,
                    device: torch.device) -> tuple[torch.Tensor, int]:
    """The prompt's (temporal, height, width) positions [3, L] and its rope delta: a token generated at
    position p after it is rotated by p + delta in all three rows (the model's `get_rope_index`)."""
    if not vision.spans:
        return torch.arange(len(prompt), device=device).expand(3, -1), 0
    ids = torch.tensor([prompt], device=device)
    positions, deltas = rope_index(ids, mm_token_type_ids=(ids == pad_id).long(),
                                   image_grid_thw=vision.images.image_grid_thw.to(device))
    return positions[:, 0], int(deltas.view(-1)[0])
