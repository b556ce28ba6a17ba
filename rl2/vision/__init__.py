"""Vision-language models (Qwen2.5-VL, Qwen3-VL): rows with images turned into model inputs, packed exactly.

- `detect`: whether a model reads images (its config has a `vision_config`);
- `images`: a row's images (paths, bytes, data URIs, PIL images) decoded, with errors naming row and field;
- `inputs`: a row's messages with image content parts / `<image>` placeholders → token ids with the image
  pads expanded, the image processor's `pixel_values` and `image_grid_thw` (no AutoProcessor, no torchvision);
- `positions`: per-sample mRoPE position ids (from the model or its config alone) and the packing of samples
  into one row;
- `placeholder`: a one-token blank image for rows without one, so the vision tower runs on every FSDP rank;
- `forward`: the stock transformers model over one packed row, text attention varlen, vision attention sdpa;
- `tower`: the vision tower found, frozen, and kept free of LoRA adapters;
- `sequence_parallel`: with sequence parallelism, the text model on this rank's share of the merged row.
- `value_model`: the token- and sequence-classification classes (a critic's, a reward model's) that transformers
  has for text models only: the backbone with a `score` head.
"""
