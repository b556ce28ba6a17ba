"""Packed-row attention: the automatic choice and its fall-backs, and every implementation that runs on
CPU against the per-sequence sdpa loop (torch's varlen kernel is CUDA-only: its wrapper is checked with
a stand-in kernel that has the same interface)."""

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl2.kernels.attention import (
    TORCH_VARLEN_ATTENTION,
    VARLEN_ATTENTION,
    available_attention,
    choose_attention,
    flash_attn_loads,
    packed_attention_implementation,
    torch_varlen_attention,
    varlen_attention,
)
from rl2.distributed.packing import pack_micro_batch
from rl2.engines.kv_slots import prefill_attention

pytestmark = pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins

CUDA = torch.device("cuda")
ALL = {"flash_attention_2": True, "torch_varlen": True, "flex_attention": True, "sdpa_loop": True}


@pytest.mark.parametrize(
    "missing,expected",
    [((), "flash_attention_2"), (("flash_attention_2",), "torch_varlen"),
     (("flash_attention_2", "torch_varlen"), "flex_attention"),
     (("flash_attention_2", "torch_varlen", "flex_attention"), "sdpa_loop")],
)
def test_auto_on_cuda_takes_the_first_available(missing, expected):
    assert choose_attention(CUDA, "auto", {**ALL, **{name: False for name in missing}}) == expected


def test_auto_on_cpu_is_the_loop_and_explicit_choices_are_checked():
    assert choose_attention(torch.device("cpu"), "auto", ALL) == "sdpa_loop"
    assert choose_attention(CUDA, "flex_attention", ALL) == "flex_attention"  # an explicit choice overrides auto
    with pytest.raises(ValueError, match="torch_varlen cannot run on cpu: it needs CUDA"):
        choose_attention(torch.device("cpu"), "torch_varlen")
    with pytest.raises(ValueError, match="must be one of"):
        choose_attention(CUDA, "sdpa", ALL)
    cpu = available_attention(torch.device("cpu"))
    assert not cpu["flash_attention_2"] and not cpu["torch_varlen"] and cpu["sdpa_loop"]


def test_float32_on_cuda_never_gets_a_flash_kernel(monkeypatch):
    """The flash kernels take fp16/bf16 only: the fp32 demo on a GPU once failed at its first SFT step with
    torch's "FlashAttention only support fp16 and bf16 data type"."""
    monkeypatch.setattr("rl2.kernels.attention.flash_attn_loads", lambda: True)
    monkeypatch.setattr("rl2.kernels.attention.torch_varlen_kernel", lambda: object())
    assert available_attention(CUDA, torch.bfloat16)["torch_varlen"]
    assert available_attention(CUDA, torch.float16)["flash_attention_2"]
    fp32 = available_attention(CUDA, torch.float32)
    assert not fp32["flash_attention_2"] and not fp32["torch_varlen"] and fp32["flex_attention"]
    assert choose_attention(CUDA, "auto", dtype=torch.float32) == "flex_attention"
    assert choose_attention(CUDA, "auto", dtype=torch.bfloat16) == "flash_attention_2"
    with pytest.raises(ValueError, match="torch_varlen cannot run on cuda: it needs bfloat16 or float16 "
                                         r"\(the model computes in float32\)"):
        choose_attention(CUDA, "torch_varlen", dtype=torch.float32)
    assert prefill_attention(CUDA, "auto", dtype=torch.float32) == "sdpa_loop"
    assert prefill_attention(CUDA, "auto", dtype=torch.bfloat16) == "flash_attention_2"


def test_registered_names():
    cpu = torch.device("cpu")
    assert packed_attention_implementation(cpu) == VARLEN_ATTENTION
    assert packed_attention_implementation(cpu, "flex_attention") == "flex_attention"


def dense_reference(query, key, value, bounds, scale):
    """Attention with an explicit block-diagonal causal mask; query [1, H, T, D], key/value [1, Hkv, T, D]."""
    heads, kv_heads, length = query.shape[1], key.shape[1], query.shape[2]
    sequence = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    position = torch.arange(length)
    visible = (sequence[:, None] == sequence[None, :]) & (position[None, :] <= position[:, None])
    kv_index = torch.arange(heads) // (heads // kv_heads)  # query head h reads KV head h // G
    scores = torch.einsum("htd,hsd->hts", query[0], key[0, kv_index]) * scale
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hts,hsd->thd", probs, value[0, kv_index]).unsqueeze(0)  # [1, T, H, D]


def stand_in_kernel(with_gqa: bool):
    """A CPU function with torch.nn.attention.varlen.varlen_attn's interface (layout [T, H, D])."""

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kwargs):
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
        bounds = cu_q.tolist()
        assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
        if k.shape[1] != q.shape[1]:
            assert kwargs.get("enable_gqa")
        out = dense_reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], bounds, scale)
        return out[0]

    if with_gqa:
        def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
            return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size, enable_gqa=enable_gqa)
        return kernel

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        # torch 2.10-2.12: no enable_gqa; aten's flash kernel takes the KV heads as they are, and they must not
        # be repeated to the query heads (G times the K/V memory)
        assert k.shape[1] < q.shape[1], "grouped-query K/V were expanded to the query heads"
        return attend(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size, enable_gqa=True)
    return kernel


@pytest.mark.parametrize("with_gqa", [True, False])
@pytest.mark.parametrize("boundaries_from", ["cu_seq_lens", "position_ids"])
def test_torch_varlen_wrapper_and_loop_equal_dense_attention(with_gqa, boundaries_from):
    generator = torch.Generator().manual_seed(0)
    bounds = [0, 5, 17, 18, 30]
    query = torch.randn(1, 6, 30, 8, generator=generator)
    key, value = torch.randn(2, 1, 2, 30, 8, generator=generator)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None]
    cu = torch.tensor(bounds, dtype=torch.int32)
    given = {"cu_seq_lens_q": cu, "max_length_q": 12} if boundaries_from == "cu_seq_lens" else {"position_ids": positions}
    expected = dense_reference(query, key, value, bounds, 0.3)
    ours, _ = torch_varlen_attention(None, query, key, value, None, scaling=0.3, kernel=stand_in_kernel(with_gqa), **given)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
    loop, _ = varlen_attention(None, query, key, value, None, scaling=0.3, **given)
    torch.testing.assert_close(loop, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lengths", [[7, 3, 7, 1, 12, 3, 7, 12, 1], [1, 1, 3, 3, 7, 7, 7, 12, 12]],
                         ids=["gathered", "sorted-slices"])
def test_the_loop_batches_equal_lengths_exactly_as_one_call_per_sequence(lengths):
    """Sequences of one length attend in one batched sdpa call: outputs and gradients equal, bit for bit, one
    call per sequence (lengths repeated, a one-token sequence, grouped-query heads); gathered from anywhere in
    the row, or taken as slices where each length is one run (rows packed by length)."""
    generator = torch.Generator().manual_seed(1)
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    query = torch.randn(1, 4, bounds[-1], 16, generator=generator, requires_grad=True)
    key, value = (torch.randn(1, 2, bounds[-1], 16, generator=generator, requires_grad=True) for _ in range(2))
    ours, _ = varlen_attention(None, query, key, value, None, scaling=0.25,
                               cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32))
    one_by_one = torch.cat([
        torch.nn.functional.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                         is_causal=True, scale=0.25, enable_gqa=True)
        for a, b in zip(bounds, bounds[1:])], dim=2).transpose(1, 2)
    assert torch.equal(ours, one_by_one)
    weights = torch.randn(ours.shape, generator=generator)
    ours_grads = torch.autograd.grad((ours * weights).sum(), (query, key, value))
    loop_grads = torch.autograd.grad((one_by_one * weights).sum(), (query, key, value))
    for got, expected in zip(ours_grads, loop_grads):
        assert torch.equal(got, expected)


def test_flex_attention_matches_the_loop_on_a_packed_row(tiny_model_dir):
    """transformers' flex attention (compiled; forward only on CPU) keeps packed sequences apart."""
    cpu = torch.device("cpu")
    loop = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=packed_attention_implementation(cpu, "sdpa_loop"))
    flex = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=packed_attention_implementation(cpu, "flex_attention"))
    generator = torch.Generator().manual_seed(2)
    row = pack_micro_batch([{"input_ids": torch.randint(0, 1000, (n,), generator=generator)} for n in (9, 140, 4, 60)])
    with torch.no_grad():
        ours = flex(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
        expected = loop(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


def test_flash_attn_counts_only_when_its_compiled_part_loads(tmp_path, monkeypatch):
    """A flash-attn built for another torch imports its Python files but not its compiled module
    (`undefined symbol`): it is not offered, and `auto` on CUDA falls back to torch's varlen kernel."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text("def flash_attn_varlen_func(*args, **kwargs):\n    raise AssertionError\n")
    broken = "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEa')\n"
    (tmp_path / "flash_attn_2_cuda.py").write_text(broken)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn_2_cuda"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert not flash_attn_loads()
    assert not available_attention(CUDA)["flash_attention_2"]
    assert choose_attention(CUDA, "auto", available_attention(CUDA)) in ("torch_varlen", "flex_attention")
    (tmp_path / "flash_attn_2_cuda.py").write_text("")  # a build that matches this torch
    for name in ("flash_attn", "flash_attn_2_cuda"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert flash_attn_loads() and available_attention(CUDA)["flash_attention_2"]
