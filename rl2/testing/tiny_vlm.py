"""Tiny Qwen2.5-VL and Qwen3-VL models, built offline from a config.

`python -m rl2.testing.tiny_vlm OUT_DIR --family qwen2_5_vl|qwen3_vl` writes a folder with random-init
weights, rl2's tiny tokenizer (`rl2.testing.tiny`) plus the vision tokens, and a PIL image processor
(no torchvision) with the family's patch size. Nothing is downloaded. Used by the vision tests.
"""

import argparse

import torch
from tokenizers import AddedToken
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rl2.testing.tiny import build_tiny_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# The families' real patch sizes (Qwen2.5-VL 14, Qwen3-VL 16) and image normalisation.
PATCH_SIZE = {"qwen2_5_vl": 14, "qwen3_vl": 16}
IMAGE_MEAN = {"qwen2_5_vl": (0.48145466, 0.4578275, 0.40821073), "qwen3_vl": (0.5, 0.5, 0.5)}
IMAGE_STD = {"qwen2_5_vl": (0.26862954, 0.26130258, 0.27577711), "qwen3_vl": (0.5, 0.5, 0.5)}


def build_tiny_vlm_tokenizer(vocab_size: int = 1024, seed: int = 0) -> PreTrainedTokenizerFast:
    """rl2's tiny ChatML tokenizer with the Qwen vision tokens added as special tokens."""
    tokenizer = build_tiny_tokenizer(vocab_size=vocab_size, seed=seed)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS]})
    return tokenizer


def build_tiny_image_processor(family: str, min_pixels: int | None = None,
                               max_pixels: int | None = None) -> Qwen2VLImageProcessorPil:
    """The family's image processor on the PIL backend; by default images are resized to at most
    16 x 16 patches (the tiny models' learned position grid for Qwen3-VL is 8 x 8 merged patches)."""
    patch = PATCH_SIZE[family]
    min_pixels = min_pixels or (2 * patch) ** 2
    max_pixels = max_pixels or (16 * patch) ** 2
    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, patch_size=patch, temporal_patch_size=2,
        merge_size=2, image_mean=IMAGE_MEAN[family], image_std=IMAGE_STD[family])


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    return dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), ids))


def build_tiny_vlm(
    tokenizer: PreTrainedTokenizerFast,
    family: str = "qwen2_5_vl",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    seed: int = 0,
) -> torch.nn.Module:
    """A random-init Qwen2.5-VL or Qwen3-VL (fp32) sized to `tokenizer`'s vocabulary and its vision tokens.

    The text model's heads are `hidden_size // num_heads` wide with mRoPE sections summing to half that;
    Qwen2.5-VL's vision tower has window attention in its first block and full attention in its last,
    Qwen3-VL's feeds DeepStack features from its first block to the text model."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    head_dim = hidden_size // num_heads
    half = head_dim // 2
    section = [half - 2 * (half // 3), half // 3, half // 3]  # temporal, height, width; sums to head_dim / 2
    text = {
        "vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": 4096, "head_dim": head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
        "bos_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {
        "depth": vision_depth, "hidden_size": vision_hidden_size, "intermediate_size": vision_hidden_size * 2,
        "num_heads": 2, "out_hidden_size": hidden_size, "patch_size": PATCH_SIZE[family],
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    if family == "qwen2_5_vl":
        vision.update(window_size=4 * PATCH_SIZE[family], fullatt_block_indexes=[vision_depth - 1])
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                                  **_token_ids(tokenizer))
        model_cls = Qwen2_5_VLForConditionalGeneration
    else:
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh")
        config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True,
                               **_token_ids(tokenizer))
        model_cls = Qwen3VLForConditionalGeneration
    torch.manual_seed(seed)
    return model_cls(config).float()


def save_tiny_vlm(out_dir: str, family: str = "qwen2_5_vl", vocab_size: int = 1024, seed: int = 0,
                  **model_kwargs) -> str:
    """Build a tiny vision-language model of `family`, its tokenizer and image processor, and save all
    three to `out_dir`; returns `out_dir`."""
    tokenizer = build_tiny_vlm_tokenizer(vocab_size=vocab_size, seed=seed)
    model = build_tiny_vlm(tokenizer, family=family, seed=seed, **model_kwargs)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    build_tiny_image_processor(family).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-init vision-language model, its tokenizer "
                                                 "and image processor to a folder.")
    parser.add_argument("out_dir")
    parser.add_argument("--family", choices=FAMILIES, default="qwen2_5_vl")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    save_tiny_vlm(args.out_dir, family=args.family, vocab_size=args.vocab_size, seed=args.seed,
                  hidden_size=args.hidden_size, num_layers=args.layers)
    print(f"tiny {args.family} model written to {args.out_dir}")


if __name__ == "__main__":
    main()
