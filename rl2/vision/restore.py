"""Images back from their processed form: a Qwen-VL image processor's `pixel_values` patches turned into the
RGB images they were cut from (resized, before rescaling and normalisation), for an engine that takes images
rather than patches (vLLM) and must see exactly the pixels, and so the patch grids, that rl2 trained on."""

import numpy as np
import torch
from PIL import Image

from rl2.vision.image_inputs import ImageInputs


def restore_images(images: ImageInputs, image_processor) -> list[Image.Image]:
    """The RGB images whose processing (by `image_processor`: its patch, merge and temporal patch sizes, mean
    and std) gave `images`: each image's first temporal frame, un-normalised and rounded to 8 bits. Each has
    the size the processor resized it to, a multiple of patch x merge, so processing it again keeps its grid."""
    patch, merge = image_processor.patch_size, image_processor.merge_size
    temporal = image_processor.temporal_patch_size
    mean = torch.tensor(image_processor.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(image_processor.image_std, dtype=torch.float32)[:, None, None]
    restored, first = [], 0
    for grid_t, grid_h, grid_w in images.image_grid_thw.tolist():
        if grid_t != 1:
            raise ValueError(f"an image of {grid_t} temporal patches is a video: only still images are restored")
        patches = images.pixel_values[first : first + grid_h * grid_w].float().cpu()
        first += grid_h * grid_w
        # [gh/m, gw/m, m, m, C, T, p, p] (the processor's layout) → the first frame, [C, H, W]
        blocks = patches.reshape(grid_h // merge, grid_w // merge, merge, merge, -1, temporal, patch, patch)[..., 0, :, :]
        frame = blocks.permute(4, 0, 2, 5, 1, 3, 6).reshape(-1, grid_h * patch, grid_w * patch)
        pixels = ((frame * std + mean) * 255).round().clamp(0, 255).to(torch.uint8)
        restored.append(Image.fromarray(np.ascontiguousarray(pixels.permute(1, 2, 0).numpy()), "RGB"))
    return restored
