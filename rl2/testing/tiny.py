"""Tiny Qwen2-architecture models and byte-level BPE tokenizers, built offline from a config.

`python -m rl2.testing.tiny OUT_DIR` writes a folder usable as `actor.model_name=OUT_DIR`: random-init
weights, a tokenizer trained locally with `tokenizers`, and a ChatML chat template (`--template` picks
another family's template and tokens: see `rl2.testing.chat_templates`). Nothing is downloaded. Used by
the tests, the benchmarks and the CPU demos.
"""

import argparse
import random

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rl2.testing.chat_templates import CHAT_TEMPLATE, FAMILIES, chat_family  # noqa: F401  (CHAT_TEMPLATE: imported from here)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen's pre-tokenisation regex: transformers rebuilds a `qwen2` folder's tokenizer as
# Qwen2Tokenizer with this split + ByteLevel(use_regex=False) + NFC, so training with the same
# pipeline keeps token ids identical whether the folder is read back as Qwen2Tokenizer or not.
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_WORDS = (
    "the a an of to and in is it you that he was for on are with as I his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how said "
    "each she which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find answer question think step solve code "
    "python print return def import search tool result information capital city country math sum "
    "product equals true false yes none list reverse sort count letter copy repeat"
).split()


def _training_corpus(n_lines: int, seed: int) -> list[str]:
    """Synthetic text: words, numbers, arithmetic, code-ish lines and chat markup."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        kind = rng.randrange(4)
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) + ".")
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"What is {a} + {b}? The answer is {a + b}. \\boxed{{{a + b}}}")
        elif kind == 2:
            name = rng.choice(_WORDS)
            lines.append(f"def {name}(x):\n    return x * {rng.randint(1, 9)}\nprint({name}({rng.randint(0, 99)}))")
        else:
            word = rng.choice(_WORDS)
            lines.append(f"<think>{word}</think> <answer>{word[::-1]}</answer> <search>{word}</search>")
    return lines


def build_tiny_tokenizer(vocab_size: int = 1024, seed: int = 0, template: str = "chatml") -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on a synthetic corpus and dress it as the `template` family.

    The trained vocabulary (ChatML special tokens first) is the same for every family; the family's
    atomic tokens are added after it, with its eos/bos/pad tokens and chat template. `chatml` adds nothing.
    """
    family = chat_family(template)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(4000, seed), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special_tokens])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain_tokens])
    bos = {"bos_token": family.bos_token} if family.bos_token else {}
    if family.add_bos:
        bos["add_bos_token"] = True  # transformers makes the post-processor prepend it
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=family.eos_token,
        pad_token=family.pad_token,
        unk_token=family.unk_token,
        chat_template=family.chat_template,
        **bos,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    intermediate_size: int | None = None,
) -> Qwen2ForCausalLM:
    """A random-init Qwen2 causal LM sized to `tokenizer`'s vocabulary, with its eos, bos and pad ids
    (bos falls back to the pad token, as Qwen's configs name `<|endoftext|>`); the MLP is twice the hidden size
    unless `intermediate_size` is given."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


@torch.no_grad()
def sharpen_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Redraw the model's matrices with larger random weights, in place.

    At the default init (std 0.02) the residual stream is mostly the input embedding and the
    embeddings are tied, so next-token distributions are nearly uniform and greedy decoding repeats
    the last token: checks on outputs prove little. Larger weights give varied, peaked distributions.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if param.dim() == 2:
            param.normal_(0.0, 0.3 if "embed_tokens" in name else 0.15, generator=generator)
    return model


def save_tiny(out_dir: str, vocab_size: int = 1024, seed: int = 0, template: str = "chatml", **model_kwargs) -> str:
    """Build a tiny tokenizer (of the `template` chat family) and model and save both to `out_dir`;
    returns `out_dir`."""
    tokenizer = build_tiny_tokenizer(vocab_size=vocab_size, seed=seed, template=template)
    model = build_tiny_model(tokenizer, seed=seed, **model_kwargs)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random-init Qwen2 model and tokenizer to a folder.")
    parser.add_argument("out_dir")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=None, help="the MLP's width (default: 2 x hidden size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--template", choices=list(FAMILIES), default="chatml",
                        help="chat template family: its template, special tokens and eos (rl2.testing.chat_templates)")
    args = parser.parse_args()
    save_tiny(
        args.out_dir,
        vocab_size=args.vocab_size,
        seed=args.seed,
        template=args.template,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
    )
    print(f"tiny model written to {args.out_dir}")


if __name__ == "__main__":
    main()
