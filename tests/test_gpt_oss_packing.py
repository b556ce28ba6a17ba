"""gpt-oss in packed rows and in the hf engine: its attention sinks and its sliding window (every other layer)
stay within each sequence. A tiny gpt-oss (`rl2.testing.tiny_moe`, window 8) in fp32 on CPU, against
transformers' own eager attention on each sequence alone and its own `generate`."""

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.masking_utils import AttentionMaskInterface

import packed_rows
from packed_rows import packed_inputs, varlen  # noqa: F401  (varlen: the fixture)
from rl2.engines import HFEngine, SamplingParams
from rl2.engines.kv_slots import prefill_attention
from rl2.errors import ConfigError
from rl2.kernels.attention import choose_attention, no_dense_mask, torch_varlen_attention, varlen_attention
from rl2.testing.tiny_moe import build_tiny_moe, save_tiny_moe

WINDOW = 8
LENGTHS = (5, 30, 17, 30, 9)  # longer than the window; one length twice (the loop batches those)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def model_with(attention: str) -> torch.nn.Module:
    return build_tiny_moe("gpt_oss", attn_implementation=attention, sliding_window=WINDOW)


def packed_and_alone(model: torch.nn.Module, attention: str) -> tuple[torch.Tensor, dict, torch.Tensor, dict]:
    """Logits and gradients of a packed row in `attention`, and of each sequence alone in transformers'
    own (eager) attention: [T, vocab] and {name: grad} each."""
    seqs = packed_rows.sequences(LENGTHS)
    weights = [torch.randn(len(s), 1024, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(seqs)]
    model.config._attn_implementation = attention
    packed = model(**packed_inputs(seqs)).logits[0]
    (packed * torch.cat(weights)).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.config._attn_implementation = "eager"
    alone = []
    for s, w in zip(seqs, weights):
        logits = model(input_ids=s[None], use_cache=False).logits[0]
        (logits * w).sum().backward()
        alone.append(logits.detach())
    alone_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return packed.detach(), packed_grads, torch.cat(alone), alone_grads


def test_a_packed_gpt_oss_row_gives_each_sequence_its_logits_and_gradients_alone(varlen):
    packed, packed_grads, alone, alone_grads = packed_and_alone(model_with(varlen), varlen)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in alone_grads.items():
        scale = grad.abs().max().item()  # fp32 sums over tokens in another order: 1e-5 of the largest
        torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=1e-5 * scale, msg=name)
    assert all(grad.abs().sum() > 0 for name, grad in packed_grads.items() if name.endswith("sinks"))


@pytest.mark.parametrize("dropped", ["s_aux", "sliding_window"])
def test_the_packed_check_fails_without_sinks_or_without_the_window(dropped):
    """Mutants of rl2's packed attention that ignore the sinks, or the window: the logits differ (so the
    check above rests on both)."""
    name = f"rl2_test_without_{dropped}"

    def mutant(*args, **kwargs):
        kwargs.pop(dropped)
        return varlen_attention(*args, **kwargs)

    AttentionInterface.register(name, mutant)
    AttentionMaskInterface.register(name, no_dense_mask)
    packed, _, alone, _ = packed_and_alone(model_with(name), name)
    assert (packed - alone).abs().max() > 1e-2


def test_torch_varlen_passes_the_window_to_its_kernel_and_refuses_sinks():
    seen = {}

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen["window_size"] = window_size
        return q

    query = key = value = torch.zeros(1, 2, 12, 4)
    torch_varlen_attention(None, query, key, value, None, kernel=kernel, sliding_window=WINDOW)
    assert seen["window_size"] == (WINDOW - 1, 0)  # the kernel counts the keys left of the query
    torch_varlen_attention(None, query, key, value, None, kernel=kernel)
    assert seen["window_size"] == (-1, 0)
    with pytest.raises(ValueError, match="sinks"):
        torch_varlen_attention(None, query, key, value, None, kernel=kernel, s_aux=torch.zeros(2))


def test_a_model_with_sinks_never_gets_a_flash_kernel():
    everything = {"flash_attention_2": True, "torch_varlen": True, "flex_attention": True, "sdpa_loop": True}
    assert choose_attention(CUDA, "auto", everything, model_type="gpt_oss") == "flex_attention"
    assert choose_attention(CUDA, "auto", everything, model_type="qwen2") == "flash_attention_2"
    assert choose_attention(CPU, "auto", everything, model_type="gpt_oss") == "sdpa_loop"
    assert prefill_attention(CUDA, "auto", everything, model_type="gpt_oss") == "sdpa_loop"
    for kernel in ("flash_attention_2", "torch_varlen"):
        with pytest.raises(ConfigError, match=f"{kernel} cannot run gpt_oss: its attention sinks"):
            choose_attention(CUDA, kernel, everything, model_type="gpt_oss")
        with pytest.raises(ConfigError, match="sinks"):
            prefill_attention(CUDA, kernel, everything, model_type="gpt_oss")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_moe(str(tmp_path_factory.mktemp("gpt_oss")), "gpt_oss", sliding_window=WINDOW)


def expected_greedy(reference, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_hf_engine_greedy_tokens_equal_transformers_generate(model_dir):
    """Prompts shorter and longer than the window, each twice (the copy shares the first's prefill), more than
    there are slots, 20 new tokens (past the window); then a next turn that extends a kept slot; and a plain
    forward of the engine's model."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in (5, 17, 12, 1)]
    prompts = [p for p in prompts for _ in range(2)]
    engine = HFEngine(model_dir, AutoTokenizer.from_pretrained(model_dir), CPU, dtype="float32", max_batch_size=4)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    generations = engine.generate(prompts, params)
    assert [g.token_ids for g in generations] == [expected_greedy(reference, p, 20) for p in prompts]

    following = prompts[2] + generations[2].token_ids + [7, 8]
    reused = engine.stats["reused_tokens"]
    assert engine.generate([following], params)[0].token_ids == expected_greedy(reference, following, 20)
    assert engine.stats["reused_tokens"] > reused  # the kept slot's cache was read, not computed again

    with torch.no_grad():  # a plain forward of the engine's model (no slot plan) keeps the sinks and the window
        ids = torch.tensor([following])
        torch.testing.assert_close(engine.model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-5)
