"""The hf engine on hybrid linear-attention models (Qwen3.5, Qwen3-Next: gated delta-nets beside full
attention): its tokens equal transformers' own `generate` (fp32, greedy) through packed prefills, continuous
batching, kept slots and next turns, and its log-probs a plain forward's; Qwen3.5 with images too."""

from concurrent.futures import Future

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl2.engines import HFEngine, SamplingParams, Turn
from rl2.testing.tiny_moe import HYBRID_FAMILIES, save_tiny_moe

CPU = torch.device("cpu")
# one prompt longer than the delta rule's 64-token chunk; one of a single token
LENGTHS = (5, 17, 70, 1, 9)
TOOL_TOKENS = [5, 6, 7]


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def family_dir(request, tmp_path_factory) -> str:
    return save_tiny_moe(str(tmp_path_factory.mktemp(request.param)), request.param)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_moe(str(tmp_path_factory.mktemp("qwen3_next")), "qwen3_next")


def engine_of(folder: str, **kwargs) -> HFEngine:
    return HFEngine(folder, AutoTokenizer.from_pretrained(folder), CPU, dtype="float32", **kwargs)


def reference_of(folder: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def prompts_of(lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]


def expected_greedy(reference, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation (its cache of conv and recurrent states), eos ignored."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(max_new_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **kwargs)


def test_greedy_tokens_equal_transformers_generate(family_dir):
    """Prompts of different lengths, each twice (n = 2), more than there are slots: packed prefills keep each
    prompt's state its own, and the second copy of a prompt copies the first's slot after the prefill."""
    prompts = [p for p in prompts_of() for _ in range(2)]
    engine = engine_of(family_dir, max_batch_size=8)
    generations = engine.generate(prompts, greedy(10))
    reference = reference_of(family_dir)
    assert [g.token_ids for g in generations] == [expected_greedy(reference, p, 10) for p in prompts]
    assert engine.stats["prefill_tokens"] == engine.stats["reused_tokens"] == sum(LENGTHS)


def test_a_prompt_shared_with_a_slot_is_computed_again(model_dir):
    """Copies of a prompt: the second, prefilled in the same round as the first, copies its slot; the third enters
    after the first finished (its slot kept) while the second runs: a slot's state covers its whole contents, not
    the prompt's prefix they share, so the prompt is computed again."""
    prompt = prompts_of((40,), seed=7)[0]
    engine = engine_of(model_dir, max_batch_size=2)
    got = {}
    engine.generate_turns([Turn(prompt, n) for n in (2, 10, 6)], greedy(10),
                          lambda i, g: got.__setitem__(i, g.token_ids), max_turns=1)
    expected = expected_greedy(reference_of(model_dir), prompt, 10)
    assert [got[i] for i in range(3)] == [expected[:2], expected, expected[:6]]
    assert engine.stats["reused_tokens"] == len(prompt) and engine.stats["prefill_tokens"] == 2 * len(prompt)


def test_logprobs_match_a_plain_forward(model_dir):
    prompts = [p for p in prompts_of(seed=1) for _ in range(2)]  # each copy samples its own answer
    engine = engine_of(model_dir, seed=3)
    generations = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True))
    reference = reference_of(model_dir)
    for prompt, generation in zip(prompts, generations):
        with torch.no_grad():
            logits = reference(input_ids=torch.tensor([prompt + generation.token_ids]), use_cache=False).logits[0]
        expected = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
        expected = expected.gather(-1, torch.tensor(generation.token_ids)[:, None])[:, 0]
        assert (expected - torch.tensor(generation.logprobs)).abs().max() < 1e-4
    assert any(a.token_ids != b.token_ids for a, b in zip(generations[::2], generations[1::2]))


def test_continuous_batching_and_reused_slots(model_dir):
    """Two slots for five requests of different lengths: requests enter slots that others left (their states
    started afresh), next to a running one, and a second call's prompts take the kept slots; after sleep too."""
    prompts, limits = prompts_of(seed=2), [3, 14, 2, 9, 5]
    engine = engine_of(model_dir, max_batch_size=2)
    got = {}
    engine.generate_turns([Turn(p, n) for p, n in zip(prompts, limits)], greedy(14),
                          lambda i, g: got.__setitem__(i, g.token_ids), max_turns=1)
    reference = reference_of(model_dir)
    assert [got[i] for i in range(5)] == [expected_greedy(reference, p, n) for p, n in zip(prompts, limits)]
    others = prompts_of((4, 30, 12), seed=3)
    assert [g.token_ids for g in engine.generate(others, greedy(6))] == [expected_greedy(reference, p, 6)
                                                                         for p in others]
    engine.sleep()
    engine.wake()
    assert engine.generate(others[:1], greedy(6))[0].token_ids == expected_greedy(reference, others[0], 6)


def test_compact_decode_steps(model_dir):
    """One long answer left in a high slot: the eager step runs the running slots alone, gathered."""
    prompts, limits = prompts_of((6, 8, 10, 12), seed=4), [2, 2, 2, 16]
    engine = engine_of(model_dir, max_batch_size=4)
    got = {}
    engine.generate_turns([Turn(p, n) for p, n in zip(prompts, limits)], greedy(16),
                          lambda i, g: got.__setitem__(i, g.token_ids), max_turns=1)
    assert engine.stats["compact_decode_steps"] > 0
    reference = reference_of(model_dir)
    assert got[3] == expected_greedy(reference, prompts[3], 16)


def test_next_turns_continue_their_kept_slots(model_dir):
    """Three turns per conversation, a tool's tokens between them. Request 0's tool answers only when
    request 1 finished its first turn, so its kept slot sits idle among decoding rows meanwhile: its state
    must not move. Every turn equals transformers' generation of the conversation so far."""
    prompts, limits = prompts_of((20, 9, 33, 14), seed=5), [3, 12, 10, 6]
    engine = engine_of(model_dir, max_batch_size=4)
    conversations = [list(p) for p in prompts]
    turns_done = [0] * len(prompts)
    held: list[Future] = []

    def on_generation(index: int, generation) -> Future | None:
        conversations[index] += generation.token_ids
        turns_done[index] += 1
        if index == 1 and held:
            future = held.pop()
            future.set_result(Turn(list(conversations[0]), limits[0]))
        if turns_done[index] == 3:
            return None
        future = Future()
        conversations[index] += TOOL_TOKENS
        if index == 0 and turns_done[0] == 1:
            held.append(future)
        else:
            future.set_result(Turn(list(conversations[index]), limits[index]))
        return future

    engine.generate_turns([Turn(p, n) for p, n in zip(prompts, limits)], greedy(12), on_generation, max_turns=3)
    assert turns_done == [3] * 4 and not held
    assert engine.stats["reused_tokens"] > 0  # next turns continued their kept slots
    reference = reference_of(model_dir)
    for prompt, limit, conversation in zip(prompts, limits, conversations):
        expected = list(prompt)
        for turn in range(3):
            expected += expected_greedy(reference, expected, limit) + (TOOL_TOKENS if turn < 2 else [])
        assert conversation == expected


def test_a_stop_string_cut_does_not_cut_the_kept_state(model_dir):
    """Found between host syncs, a stop string cuts the answer before tokens the slot's state has already
    taken in: a next turn after the cut is computed afresh, and equals transformers'."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = reference_of(model_dir)
    prompt = prompts_of((24,), seed=6)[0]
    answer = expected_greedy(reference, prompt, 20)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    stop, end = next((text, i + 1) for i in range(2, 12)
                     if (text := decode(answer[i:i + 1])) and "\ufffd" not in text and text not in decode(answer[:i])
                     and (i + 1) % 5 != 1)  # not at a host sync (after 1, 6, 11 tokens): tokens after it were fed
    engine = engine_of(model_dir, sync_interval=5)
    cut = engine.generate([prompt], greedy(20, stop=[stop]))[0]
    assert cut.token_ids == answer[:end] and cut.finish_reason == "stop"
    following = prompt + cut.token_ids + TOOL_TOKENS
    assert engine.generate([following], greedy(6))[0].token_ids == expected_greedy(reference, following, 6)


def save_hybrid_vlm(folder: str) -> str:
    """A tiny random Qwen3.5 vision-language model (its text model a hybrid: a gated delta-net, then full
    attention with interleaved mRoPE), with `rl2.testing.tiny_vlm`'s tokenizer and image processor."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from rl2.testing.tiny import sharpen_weights
    from rl2.testing.tiny_vlm import _token_ids, build_tiny_image_processor, build_tiny_vlm_tokenizer

    tokenizer = build_tiny_vlm_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True, "partial_rotary_factor": 1.0},
                bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, **_token_ids(tokenizer))
    torch.manual_seed(0)
    sharpen_weights(Qwen3_5ForConditionalGeneration(config).float()).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    build_tiny_image_processor("qwen3_vl").save_pretrained(folder)
    return folder


def test_a_hybrid_vision_language_model(tmp_path):
    """Qwen3.5 with images: its tokens equal the model's own `generate`, its log-probs a full forward's."""
    from transformers import AutoModelForImageTextToText

    from test_vision_engine import full_forward_logprobs, generate, model_inputs, picture, prompt_sample

    folder = save_hybrid_vlm(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    samples = [prompt_sample(folder, tokenizer, "<image> and <image>: what differs?",
                             [picture(56, 84, 1), picture(64, 48, 2)]),
               prompt_sample(folder, tokenizer, "what is in <image>?", [picture(70, 70, 3)]),
               prompt_sample(folder, tokenizer, "say something without a picture", [])]
    engine = engine_of(folder)
    assert engine.vision and engine.linear is not None
    generations = generate(engine, samples, greedy(10))
    reference = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    for sample, generation in zip(samples, generations):
        with torch.no_grad():
            expected = reference.generate(**model_inputs(sample), max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert generation.token_ids == expected[0, sample["input_ids"].shape[0]:].tolist()
        logprobs = full_forward_logprobs(reference, sample, generation.token_ids)
        assert (logprobs - torch.tensor(generation.logprobs)).abs().max() < 1e-4
