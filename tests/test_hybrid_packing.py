"""Hybrid linear-attention models (Qwen3.5, Qwen3-Next: gated delta-nets beside full attention) in packed rows,
through `rl2.models.linear_attention`'s per-sequence path, on tiny models built offline, in fp32 on CPU."""

import pytest
import torch

import packed_rows
from packed_rows import packed_inputs, varlen  # noqa: F401  (varlen: the fixture)
from rl2.models.linear_attention import PACKING_KWARGS, PerSequenceLinearAttention
from rl2.testing.tiny_moe import HYBRID_FAMILIES, build_tiny_hybrid, build_tiny_moe

# two sequences of one length (batched together), one longer than the delta rule's 64-token chunk
LENGTHS = (7, 7, 13, 70, 5)
# the same lengths with those two apart (as rl2 leaves a row of preference pairs: not sorted by length)
APART = (7, 13, 7, 70, 5)


def sequences(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    return packed_rows.sequences(lengths, seed)


def positions_only(inputs: dict) -> dict:
    return {name: value for name, value in inputs.items() if name not in PACKING_KWARGS}


def alone(model: torch.nn.Module, seqs: list[torch.Tensor], weights: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Each sequence's logits from its own forward (and, with `weights`, the gradients of sum(logits * weight))."""
    outputs = []
    for i, s in enumerate(seqs):
        logits = model(input_ids=s[None], position_ids=torch.arange(len(s))[None], use_cache=False).logits[0]
        if weights is not None:
            (logits * weights[i]).sum().backward()
        outputs.append(logits.detach())
    return torch.cat(outputs)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("bounds,lengths", [("cu_seqlens", LENGTHS), ("position_ids", LENGTHS), ("cu_seqlens", APART)],
                         ids=["cu_seqlens", "position_ids", "lengths-apart"])
def test_a_packed_hybrid_row_gives_each_sequence_its_logits_alone(family, bounds, lengths, varlen):
    model = build_tiny_hybrid(family, attn_implementation=varlen)
    seqs = sequences(lengths)
    inputs = packed_inputs(seqs) if bounds == "cu_seqlens" else positions_only(packed_inputs(seqs))
    with PerSequenceLinearAttention(model), torch.no_grad():
        packed = model(**inputs).logits[0]
    with torch.no_grad():
        expected = alone(model, seqs)
    torch.testing.assert_close(packed, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("lengths", [LENGTHS, APART], ids=["by-length", "lengths-apart"])
def test_a_packed_hybrid_row_gives_each_sequence_its_gradients_alone(lengths, varlen):
    model = build_tiny_hybrid("qwen3_5", attn_implementation=varlen)
    seqs = sequences(lengths)
    weights = [torch.randn(len(s), 1024, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]
    with PerSequenceLinearAttention(model):
        (model(**packed_inputs(seqs)).logits[0] * torch.cat(weights)).sum().backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    alone(model, seqs, weights)
    for name, p in model.named_parameters():
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(packed[name], p.grad, rtol=0, atol=1e-5 * scale, msg=name)
    assert model.model.layers[0].linear_attn.A_log.grad.abs().sum() > 0


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_without_the_path_a_packed_row_raises_or_mixes_its_sequences(family, varlen):
    model = build_tiny_hybrid(family, attn_implementation=varlen)
    seqs = sequences()
    with torch.no_grad():
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            model(**packed_inputs(seqs))
        mixed = model(**positions_only(packed_inputs(seqs))).logits[0]
        expected = alone(model, seqs)
    first = len(seqs[0])
    torch.testing.assert_close(mixed[:first], expected[:first], rtol=0, atol=2e-5)  # nothing before it to carry
    assert (mixed[first:] - expected[first:]).abs().max() > 1e-2


def test_closing_puts_the_layers_own_forward_back(varlen):
    model = build_tiny_hybrid("qwen3_5", attn_implementation=varlen)
    mixer = model.model.layers[0].linear_attn
    with PerSequenceLinearAttention(model):
        assert "forward" in mixer.__dict__
    assert "forward" not in mixer.__dict__ and not model.model.layers[0]._forward_pre_hooks
    with pytest.raises(ValueError, match="can't keep packed sequences apart"), torch.no_grad():
        model(**packed_inputs(sequences()))


def test_generation_with_a_cache_is_unchanged_by_the_path(varlen):
    model = build_tiny_hybrid("qwen3_next")
    prompt = sequences((6,))[0][None]
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        plain = model.generate(prompt, **settings)
        with PerSequenceLinearAttention(model):
            with_path = model.generate(prompt, **settings)
    assert torch.equal(plain, with_path)


def test_a_model_without_linear_attention_is_refused():
    with pytest.raises(ValueError, match="no linear-attention layer"):
        PerSequenceLinearAttention(build_tiny_moe("qwen3_moe"))
