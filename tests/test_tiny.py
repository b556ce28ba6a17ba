import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl2.testing.tiny import build_tiny_tokenizer

pytestmark = pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins


def test_tiny_folder_loads_back_with_auto_classes(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reference = build_tiny_tokenizer()
    texts = [
        "Hello world!\n  What is 12 + 7?\n\n\tdef f(x):\n    return x",
        "ünïcödé 漢字 🙂 trailing spaces   ",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    ]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ids == reference(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text  # byte-level: spaces and newlines survive
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") != tokenizer.unk_token_id

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tokenizer)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    assert torch.isfinite(logits).all()
