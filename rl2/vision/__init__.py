"""Vision-language models (Qwen2.5-VL, Qwen3-VL): rows with images turned into model inputs, packed exactly.

- `images`: a row's images (paths, bytes, data URIs, PIL images) decoded, with errors naming row and field;
- `inputs`: a row's messages with image content parts / `<image>` placeholders → token ids with the image
  pads expanded, the image processor's `pixel_values` and `image_grid_thw` (no AutoProcessor, no torchvision);
- `positions`: per-sample mRoPE position ids and the packing of such samples into one row;
- `forward`: the stock transformers model over one packed row, text attention varlen, vision attention sdpa.
"""
