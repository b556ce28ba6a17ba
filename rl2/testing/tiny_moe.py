"""Tiny mixture-of-experts and hybrid linear-attention causal LMs, built offline from a config.

`build_tiny_moe` makes a Qwen3-MoE, OLMoE or gpt-oss model (8 experts, top-2 by default);
`build_tiny_hybrid` a Qwen3.5 (gated delta-net layers beside full attention, dense MLP) or Qwen3-Next
(the same mixers with MoE MLPs) model. Random weights, drawn larger than the init (as
`rl2.testing.tiny.sharpen_weights` does, the experts' stacked weights and gpt-oss's attention sinks too) so that router logits are far
from ties, routing matters and outputs vary. Nothing is downloaded. `save_tiny_moe` writes one, with
`rl2.testing.tiny`'s tokenizer, to a folder usable as `actor.model_name` (`python -m rl2.testing.tiny_moe OUT_DIR
--family F`).
"""

import argparse

import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PreTrainedModel,
    Qwen3_5ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_5 import Qwen3_5TextConfig

from rl2.testing.tiny import build_tiny_tokenizer, sharpen_weights

MOE_FAMILIES = ("qwen3_moe", "olmoe", "gpt_oss")
HYBRID_FAMILIES = ("qwen3_5", "qwen3_next")


def _shared(vocab_size: int, hidden_size: int, num_layers: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )


def build_tiny_moe(
    family: str = "qwen3_moe",
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    attn_implementation: str | None = None,
    sliding_window: int = 16,
) -> PreTrainedModel:
    """A random-init MoE causal LM of `family` (one of MOE_FAMILIES), every layer's MLP a router over
    `num_experts` experts of which each token uses `top_k`. Qwen3-MoE renormalises its top-k weights
    (as Qwen3-30B-A3B does), OLMoE does not (as OLMoE-1B-7B), gpt-oss takes a softmax over its top-k logits
    (its attention has sinks, and a `sliding_window` on every other layer, the first included)."""
    shared = _shared(vocab_size, hidden_size, num_layers)
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(**shared, num_experts=num_experts, num_experts_per_tok=top_k,
                                moe_intermediate_size=hidden_size, intermediate_size=hidden_size * 2,
                                head_dim=hidden_size // 4, norm_topk_prob=True, decoder_sparse_step=1)
        model_cls = Qwen3MoeForCausalLM
    elif family == "olmoe":
        config = OlmoeConfig(**shared, num_experts=num_experts, num_experts_per_tok=top_k,
                             intermediate_size=hidden_size, norm_topk_prob=False)
        model_cls = OlmoeForCausalLM
    elif family == "gpt_oss":
        config = GptOssConfig(**shared, num_local_experts=num_experts, num_experts_per_tok=top_k,
                              intermediate_size=hidden_size, head_dim=hidden_size // 4, sliding_window=sliding_window,
                              layer_types=["sliding_attention", "full_attention"] * (num_layers // 2)
                              + ["sliding_attention"] * (num_layers % 2))
        model_cls = GptOssForCausalLM
    else:
        raise ValueError(f"family must be one of {MOE_FAMILIES}, got {family!r}")
    return _build(model_cls, config, seed, attn_implementation)


def build_tiny_hybrid(
    family: str = "qwen3_5",
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A random-init hybrid causal LM of `family` (one of HYBRID_FAMILIES): layers alternate a gated
    delta-net (linear attention, a short causal convolution before it) and full attention, first one
    linear. Qwen3-Next's MLPs are MoE (`num_experts`, `top_k`, a shared expert)."""
    shared = _shared(vocab_size, hidden_size, num_layers)
    linear = dict(
        layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(num_layers)],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        head_dim=hidden_size // 4,
        intermediate_size=hidden_size * 2,
    )
    if family == "qwen3_5":
        config = Qwen3_5TextConfig(**shared, **linear)
        model_cls = Qwen3_5ForCausalLM
    elif family == "qwen3_next":
        config = Qwen3NextConfig(**shared, **linear, num_experts=num_experts, num_experts_per_tok=top_k,
                                 moe_intermediate_size=hidden_size, shared_expert_intermediate_size=hidden_size,
                                 norm_topk_prob=True, decoder_sparse_step=1)
        model_cls = Qwen3NextForCausalLM
    else:
        raise ValueError(f"family must be one of {HYBRID_FAMILIES}, got {family!r}")
    return _build(model_cls, config, seed, attn_implementation)


def _build(model_cls: type, config, seed: int, attn_implementation: str | None) -> PreTrainedModel:
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = sharpen_weights(model_cls(config).float(), seed=seed)
    with torch.no_grad():  # the experts' stacked [experts, out, in] weights too, so that routing matters
        generator = torch.Generator().manual_seed(seed + 1)
        experts = getattr(config, "num_experts", None)
        for name, parameter in model.named_parameters():
            if parameter.dim() == 3 and parameter.shape[0] == experts:
                parameter.normal_(0.0, 0.15, generator=generator)
            elif name.endswith(".sinks"):  # gpt-oss's attention sinks: per head, of the scores' size, so that they matter
                parameter.normal_(0.0, 1.0, generator=generator)
    return model


def save_tiny_moe(out_dir: str, family: str = "qwen3_moe", vocab_size: int = 1024, seed: int = 0,
                  **model_kwargs) -> str:
    """Build `rl2.testing.tiny`'s tokenizer and a tiny MoE or hybrid model of `family` sized to it (its
    eos, bos and pad ids set) and save both to `out_dir`; returns `out_dir`."""
    tokenizer = build_tiny_tokenizer(vocab_size=vocab_size, seed=seed)
    build = build_tiny_hybrid if family in HYBRID_FAMILIES else build_tiny_moe
    model = build(family, vocab_size=len(tokenizer), seed=seed, **model_kwargs)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.config.bos_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-init MoE or hybrid model and its tokenizer.")
    parser.add_argument("out_dir")
    parser.add_argument("--family", choices=MOE_FAMILIES + HYBRID_FAMILIES, default="qwen3_moe")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    save_tiny_moe(args.out_dir, args.family, vocab_size=args.vocab_size, seed=args.seed, hidden_size=args.hidden_size,
                  num_layers=args.layers, num_experts=args.experts, top_k=args.top_k)
    print(f"tiny {args.family} model written to {args.out_dir}")


if __name__ == "__main__":
    main()
