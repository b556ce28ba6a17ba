"""Vision-language samples packed in one row (issue 68): Qwen2.5-VL and Qwen3-VL (DeepStack), tiny and
random, built offline. Each sample of a packed row gets the logits and gradients it gets alone from the
stock transformers forward; the mRoPE positions and the bidirectional vision attention are what make it so.
A row split over 2 ranks (sequence parallelism) gives what one rank gives."""

import base64
import io
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from conftest import assert_same_gradients, run_python, run_torchrun
from rl2.data.rows import DataError
from rl2.testing.tiny import sharpen_weights
from rl2.testing.tiny_vlm import build_tiny_image_processor, build_tiny_vlm, build_tiny_vlm_tokenizer
from rl2.vision.forward import packed_vision_forward, packed_vision_inputs, vision_attention_implementation
from rl2.vision.inputs import IMAGE_PAD, build_vision_sample
from rl2.vision.placeholder import with_placeholder_image
from rl2.vision.tower import MERGERS, VISION_TOWER_MODULES, freeze_vision_tower, vision_tower
from rl2.vision.positions import (VISION_POSITIONS, mrope_position_ids, pack_vision_samples, rope_index_from_config,
                                  rope_index_of)

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
FSDP_WORKER = "tests/workers/vision_fsdp_step.py"
SP_WORKER = "tests/workers/vision_sp_step.py"
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=FAMILIES)
def vlm_dir(request, tmp_path_factory) -> str:
    """A tiny random vision-language model of each family, with peaked weights (`sharpen_weights`) so that
    positions and attention show in the logits."""
    folder = str(tmp_path_factory.mktemp(request.param))
    tokenizer = build_tiny_vlm_tokenizer()
    sharpen_weights(build_tiny_vlm(tokenizer, family=request.param)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    build_tiny_image_processor(request.param).save_pretrained(folder)
    return folder


def load(folder: str, attn_implementation) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(folder, attn_implementation=attn_implementation,
                                                       dtype=torch.float32)


def picture(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def mixed_rows(patch: int) -> list[dict]:
    """Three rows with images of different grids (one with two images, given three ways) and one without."""
    return [
        {"messages": [{"role": "user", "content": "<image> what is the sum of a"},
                      {"role": "assistant", "content": "the answer is 3"}],
         "images": [picture(4 * patch, 4 * patch, 0)]},
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "look at"}, {"type": "image"}, {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": data_uri(picture(4 * patch, 8 * patch, 1))}},
        ]}, {"role": "assistant", "content": "yes they are"}],
         "images": [png_bytes(picture(6 * patch, 4 * patch, 2))]},
        {"messages": [{"role": "user", "content": "no image here, just words"},
                      {"role": "assistant", "content": "one two"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": picture(8 * patch, 6 * patch, 3)},
                                                   {"type": "text", "text": "count"}]},
                      {"role": "assistant", "content": "four"}]},
    ]


def samples_of(folder: str) -> list[dict]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
    return [build_vision_sample(row, i, tokenizer, processor) for i, row in enumerate(mixed_rows(processor.patch_size))]


def alone_logits(model, sample: dict) -> torch.Tensor:
    """The stock forward of one sample, unpacked: transformers computes its mRoPE positions itself."""
    images = {k: sample[k] for k in ("pixel_values", "image_grid_thw") if k in sample}
    return model(input_ids=sample["input_ids"][None], mm_token_type_ids=sample["mm_token_type_ids"][None],
                 use_cache=False, **images).logits[0]


def split(logits: torch.Tensor, row: dict) -> list[torch.Tensor]:
    bounds = row["cu_seqlens"].tolist()
    return [logits[0, start:end] for start, end in zip(bounds[:-1], bounds[1:])]


def test_tiny_vlm_folders_load_back_with_auto_classes_and_no_torchvision(vlm_dir):
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    processor = AutoImageProcessor.from_pretrained(vlm_dir, backend="pil")
    model = load(vlm_dir, "sdpa")
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil"
    assert "torchvision" not in sys.modules
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert model.config.text_config.vocab_size == len(tokenizer)
    assert sum(p.numel() for p in model.parameters()) < 500_000


def test_the_command_line_writes_a_folder_that_loads(tmp_path):
    out = str(tmp_path / "qwen3_vl")
    run_python(["-m", "rl2.testing.tiny_vlm", out, "--family", "qwen3_vl"])
    model = load(out, "sdpa")
    assert model.config.model_type == "qwen3_vl" and model.config.vision_config.deepstack_visual_indexes == [0]
    assert AutoImageProcessor.from_pretrained(out, backend="pil").patch_size == 16


def test_a_sample_has_one_pad_token_per_merged_patch_and_no_image_token_in_the_loss(vlm_dir):
    samples = samples_of(vlm_dir)
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert [s["image_grid_thw"].shape[0] if "image_grid_thw" in s else 0 for s in samples] == [1, 2, 0, 1]
    grids = torch.cat([s["image_grid_thw"] for s in samples if "image_grid_thw" in s])
    assert len({tuple(g) for g in grids.tolist()}) == 4  # four different grids
    for sample in samples:
        is_image = sample["input_ids"] == pad
        assert torch.equal(is_image.long(), sample["mm_token_type_ids"])
        expected = int(sample["image_grid_thw"].prod(-1).sum()) // 4 if "image_grid_thw" in sample else 0
        assert int(is_image.sum()) == expected
        assert sample["loss_mask"].sum() > 0 and not sample["loss_mask"][is_image].any()


def test_a_packed_row_gives_each_sample_the_logits_it_gets_alone(vlm_dir):
    samples = samples_of(vlm_dir)
    packed_model = load(vlm_dir, vision_attention_implementation(CPU))
    reference = load(vlm_dir, "sdpa")
    row = pack_vision_samples(samples, rope_index_of(packed_model))
    assert row[VISION_POSITIONS].shape == (3, 1, row["input_ids"].shape[1])
    assert row["image_grid_thw"].shape == (4, 3)
    with torch.no_grad():
        packed = split(packed_vision_forward(packed_model, row), row)
        for sample, logits in zip(samples, packed):
            torch.testing.assert_close(logits, alone_logits(reference, sample), rtol=0, atol=1e-5)


def test_positions_from_the_config_alone_are_the_models(vlm_dir):
    """Data workers position samples without the weights (a model on the meta device)."""
    from_config = rope_index_from_config(AutoConfig.from_pretrained(vlm_dir))
    from_model = rope_index_of(load(vlm_dir, "sdpa"))
    for sample in samples_of(vlm_dir):
        torch.testing.assert_close(mrope_position_ids(from_config, sample), mrope_position_ids(from_model, sample),
                                   rtol=0, atol=0)


def test_a_completion_of_the_stock_generate_scores_the_same_packed(vlm_dir):
    """What RL trains on: a prompt with images, a completion from the stock `generate` (which positions each
    new token by the prompt's rope delta), then the whole sequence packed beside another sample: the
    packed forward gives each completion token the logits `generate` computed for it."""
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    processor = AutoImageProcessor.from_pretrained(vlm_dir, backend="pil")
    rows = mixed_rows(processor.patch_size)
    prompt = build_vision_sample({**rows[1], "messages": rows[1]["messages"][:1]}, 1, tokenizer, processor,
                                 add_generation_prompt=True)
    assert not prompt["loss_mask"].any()
    reference = load(vlm_dir, "sdpa")
    images = {k: prompt[k] for k in ("pixel_values", "image_grid_thw")}
    out = reference.generate(input_ids=prompt["input_ids"][None], mm_token_type_ids=prompt["mm_token_type_ids"][None],
                             max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **images)
    n_prompt, completion = len(prompt["input_ids"]), out.sequences[0, len(prompt["input_ids"]):]
    assert len(set(completion.tolist())) > 1  # peaked weights: not one token repeated
    whole = {"input_ids": out.sequences[0], "loss_mask": (torch.arange(len(out.sequences[0])) >= n_prompt).long(),
             "mm_token_type_ids": F.pad(prompt["mm_token_type_ids"], (0, len(completion))), **images}
    model = load(vlm_dir, vision_attention_implementation(CPU))
    row = pack_vision_samples([samples_of(vlm_dir)[0], whole], rope_index_of(model))
    with torch.no_grad():
        logits = split(packed_vision_forward(model, row), row)[1][n_prompt - 1:-1]
    torch.testing.assert_close(logits, torch.cat(out.logits), rtol=0, atol=1e-5)  # raw, before min_new_tokens


def test_one_dimensional_positions_change_the_image_samples_logits(vlm_dir):
    """The negative control: rl2's text-only packing (positions 0..L-1 on all rows) is wrong for images."""
    samples = samples_of(vlm_dir)
    model = load(vlm_dir, vision_attention_implementation(CPU))
    row = pack_vision_samples(samples, rope_index_of(model))
    flat = dict(row, **{VISION_POSITIONS: row["position_ids"].unsqueeze(0).expand(3, -1, -1)})
    with torch.no_grad():
        right, wrong = (split(packed_vision_forward(model, r), r) for r in (row, flat))
    for i, (a, b) in enumerate(zip(right, wrong)):
        if "image_grid_thw" in samples[i]:
            assert (a - b).abs().max() > 0.1
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # text-only: mRoPE is 1-D RoPE


def test_the_vision_tower_needs_bidirectional_attention(vlm_dir):
    """rl2's (causal) packed-row attention on the vision tower too changes the image samples' logits:
    `vision_attention_implementation` keeps the tower on sdpa, and the packed forward refuses any other."""
    samples = samples_of(vlm_dir)
    causal_everywhere = load(vlm_dir, vision_attention_implementation(CPU)["text_config"])
    reference = load(vlm_dir, "sdpa")
    row = pack_vision_samples(samples, rope_index_of(causal_everywhere))
    with pytest.raises(ValueError, match="the vision tower's attention is 'rl2_varlen'"):
        packed_vision_forward(causal_everywhere, row)
    with torch.no_grad():
        packed = split(causal_everywhere(**packed_vision_inputs(row)).logits, row)
        assert (packed[0] - alone_logits(reference, samples[0])).abs().max() > 0.1


def token_loss(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over the loss-mask tokens of one sequence ([L, vocab], [L], [L])."""
    losses = F.cross_entropy(logits[:-1], input_ids[1:], reduction="none")
    return (losses * loss_mask[1:]).sum()


def test_the_packed_loss_has_the_gradients_of_the_samples_alone(vlm_dir):
    samples = samples_of(vlm_dir)
    packed_model = load(vlm_dir, vision_attention_implementation(CPU))
    reference = load(vlm_dir, "sdpa")
    row = pack_vision_samples(samples, rope_index_of(packed_model))
    logits = split(packed_vision_forward(packed_model, row), row)
    sum(token_loss(lg, s["input_ids"], s["loss_mask"]) for lg, s in zip(logits, samples)).backward()
    for sample in samples:
        token_loss(alone_logits(reference, sample), sample["input_ids"], sample["loss_mask"]).backward()
    ours = {name: p.grad for name, p in packed_model.named_parameters()}
    expected = {name: p.grad for name, p in reference.named_parameters()}
    assert all(g is not None for g in expected.values())
    assert_same_gradients(ours, expected)


def test_an_image_free_row_runs_the_vision_tower_on_a_placeholder_that_changes_nothing(vlm_dir):
    """FSDP needs every rank in the vision tower's collectives: a row without images gets a one-token
    placeholder sequence with a blank image; the other samples' logits are theirs, the loss's gradients 0."""
    samples = [s for s in samples_of(vlm_dir) if "pixel_values" not in s]
    model = load(vlm_dir, vision_attention_implementation(CPU))
    with_image = with_placeholder_image(samples, model.config)
    assert len(with_image) == len(samples) + 1 and with_placeholder_image(with_image, model.config) == with_image
    row = pack_vision_samples(with_image, rope_index_of(model))
    plain = pack_vision_samples(samples, rope_index_of(model))
    assert row["image_grid_thw"].tolist() == [[1, 2, 2]] and "pixel_values" not in plain
    logits = split(packed_vision_forward(model, row), row)
    with torch.no_grad():
        torch.testing.assert_close(logits[0], split(packed_vision_forward(model, plain), plain)[0], rtol=0, atol=1e-6)
    sum(token_loss(lg, s["input_ids"], s["loss_mask"]) for lg, s in zip(logits, with_image)).backward()
    visual = model.model.visual
    assert all(p.grad is not None for p in visual.parameters())
    assert all(not p.grad.any() for p in visual.parameters())


def test_two_fsdp_ranks_one_without_images_give_the_gradients_of_the_samples_alone(vlm_dir, tmp_path):
    """Rank 1's row has no image: it runs the vision tower on the placeholder, so FSDP's collectives line
    up (no hang), and the averaged gradients are those of the samples run alone."""
    samples = samples_of(vlm_dir)
    torch.save([[samples[0], samples[1], samples[3]], [samples[2]]], tmp_path / "samples.pt")
    run_torchrun([FSDP_WORKER, vlm_dir, str(tmp_path / "samples.pt"), str(tmp_path / "out.pt")], nproc=2, timeout=240)
    result = torch.load(tmp_path / "out.pt")
    assert result["n_images"] == 4
    reference = load(vlm_dir, "sdpa")
    for sample in samples:  # FSDP averages the ranks' gradients
        (token_loss(alone_logits(reference, sample), sample["input_ids"], sample["loss_mask"]) / 2).backward()
    assert_same_gradients(result["grads"], {name: p.grad for name, p in reference.named_parameters()})


def test_sequence_parallel_gives_the_log_probs_and_gradients_of_one_rank(vlm_dir, tmp_path):
    """actor.sp_size=2 on 2 ranks, the samples in one row: each rank runs the vision tower over the whole row
    and merges its features into the embeddings (with Qwen3-VL the DeepStack ones too), the text model runs
    on the rank's ZigZag share with ring attention. Every token's log-prob, the loss and the gradients of the
    text model and of the trained vision tower (counted once, not once per rank) are one rank's; the SP run
    takes its log-probs from the chunked head."""
    samples = samples_of(vlm_dir)
    assert any(len(s["input_ids"]) % 4 for s in samples)  # a sequence the zigzag split pads
    torch.save(samples, tmp_path / "samples.pt")
    args = [SP_WORKER, vlm_dir, str(tmp_path / "samples.pt")]
    run_python([*args, str(tmp_path / "one.pt"), "1"])
    run_torchrun([*args, str(tmp_path / "sp.pt"), "2", "5"], nproc=2, timeout=240)
    one, sp = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "sp.pt")
    assert len(one["text_logps"]) == 1  # a row without images: its placeholder image's token on one rank only
    for expected, ours in zip(one["logps"] + one["text_logps"], sp["logps"] + sp["text_logps"], strict=True):
        assert expected[1:].ne(0).all()  # every token but the first of each sequence
        torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    assert sp["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert sum(name.startswith("model.visual.") for name in one["grads"]) > 10
    assert_same_gradients(sp["grads"], one["grads"], rtol=1e-5)


def test_flex_attention_is_refused_for_vision_language_models():
    with pytest.raises(ValueError, match="no flex attention for Qwen-VL models; use sdpa_loop"):
        vision_attention_implementation(CPU, "flex_attention")
    assert vision_attention_implementation(CPU) == {"text_config": "rl2_varlen", "vision_config": "sdpa"}


@pytest.mark.parametrize("keep_mergers", [False, True])
def test_a_frozen_vision_tower_is_unchanged_by_a_step_and_the_rest_trains(vlm_dir, keep_mergers):
    samples = samples_of(vlm_dir)
    model = load(vlm_dir, vision_attention_implementation(CPU))
    frozen = freeze_vision_tower(model, keep_mergers=keep_mergers)
    assert any(name.startswith("blocks.") for name in frozen)
    assert any(name.startswith("merger.") for name in frozen) != keep_mergers
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    row = pack_vision_samples(samples, rope_index_of(model))
    logits = split(packed_vision_forward(model, row), row)
    sum(token_loss(lg, s["input_ids"], s["loss_mask"]) for lg, s in zip(logits, samples)).backward()
    optimizer.step()
    for name, p in model.named_parameters():
        in_tower = name.startswith("model.visual.")
        is_merger = in_tower and name.split(".")[2] in MERGERS
        assert torch.equal(p, before[name]) == (in_tower and not (keep_mergers and is_merger)), name


def test_lora_adapters_stay_off_the_vision_tower(vlm_dir):
    from peft import LoraConfig, get_peft_model

    def adapted(exclude) -> list[str]:
        model = get_peft_model(load(vlm_dir, "sdpa"), LoraConfig(r=4, target_modules="all-linear",
                                                                 exclude_modules=exclude))
        assert vision_tower(model) is model.base_model.model.model.visual
        return [name for name, _ in model.named_modules() if name.endswith("lora_A")]

    assert sum(".visual." in name for name in adapted(None)) == 12  # peft's all-linear alone: 12 of 26
    kept = adapted(VISION_TOWER_MODULES)
    assert len(kept) == 14 and not any(".visual." in name for name in kept)  # 2 layers x 7 projections


# ---- rows that cannot be turned into samples: the error names the row and the field ----


@pytest.fixture(scope="module")
def text_side():
    """The tokenizer and image processor of the tiny Qwen2.5-VL (no model needed)."""
    return build_tiny_vlm_tokenizer(), build_tiny_image_processor("qwen2_5_vl")


def sample_of(row: dict, index: int, text_side, **kwargs) -> dict:
    tokenizer, processor = text_side
    return build_vision_sample(row, index, tokenizer, processor, **kwargs)


def test_a_missing_image_file_names_the_row_and_field(text_side, tmp_path):
    missing = str(tmp_path / "nowhere.png")
    row = {"messages": [{"role": "user", "content": "<image> hi"}], "images": [missing]}
    with pytest.raises(DataError, match=r"row 5, 'images'\[0\]: image file not found: .*nowhere\.png"):
        sample_of(row, 5, text_side)
    part = {"messages": [{"role": "user", "content": [{"type": "image", "image": missing}]}]}
    with pytest.raises(DataError, match=r"row 6, 'messages'\[0\]\.content\[0\]: image file not found"):
        sample_of(part, 6, text_side)


def test_an_image_count_that_does_not_match_the_placeholders_names_the_row_and_field(text_side):
    image = picture(56, 56, 0)
    two_placeholders = {"messages": [{"role": "user", "content": "<image> and <image>"}], "images": [image]}
    with pytest.raises(DataError, match=r"row 2: 'images' has 1 image\(s\) but the messages have 2 <image> "):
        sample_of(two_placeholders, 2, text_side)
    no_placeholder = {"messages": [{"role": "user", "content": "hi"}], "pics": [image, image]}
    with pytest.raises(DataError, match=r"row 3: 'pics' has 2 image\(s\) but the messages have 0"):
        sample_of(no_placeholder, 3, text_side, image_key="pics")


def test_an_image_past_max_length_names_the_row_and_field_and_is_never_cut(text_side):
    row = {"messages": [{"role": "user", "content": "some words first <image>"},
                        {"role": "assistant", "content": "a long answer " * 10}],
           "images": [picture(8 * 14, 8 * 14, 0)]}  # 16 image tokens
    whole = sample_of(row, 0, text_side)
    image_end = int(whole["mm_token_type_ids"].nonzero().max()) + 1
    with pytest.raises(DataError, match=rf"row 7: the image at 'images'\[0\] \(16 tokens, grid \[1, 8, 8\]\) "
                                        rf"ends at token {image_end}, past max_length {image_end - 1}"):
        sample_of(row, 7, text_side, max_length=image_end - 1)
    cut = sample_of(row, 7, text_side, max_length=image_end + 2)  # the cut falls after the image: allowed
    assert cut["input_ids"].tolist() == whole["input_ids"][: image_end + 2].tolist()
    assert int(cut["mm_token_type_ids"].sum()) == 16


def test_max_pixels_bounds_an_images_token_count(text_side):
    row = {"messages": [{"role": "user", "content": "<image>"}], "images": [picture(16 * 14, 16 * 14, 0)]}
    assert sample_of(row, 0, text_side)["image_grid_thw"].tolist() == [[1, 16, 16]]
    small = sample_of(row, 0, text_side, max_pixels=(4 * 14) ** 2)
    assert small["image_grid_thw"].tolist() == [[1, 4, 4]] and int(small["mm_token_type_ids"].sum()) == 4


def test_an_unreadable_image_and_a_url_name_the_row_and_field(text_side):
    garbage = {"messages": [{"role": "user", "content": "<image>"}], "images": [b"not an image"]}
    with pytest.raises(DataError, match=r"row 1, 'images'\[0\]: not a readable image"):
        sample_of(garbage, 1, text_side)
    url = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}
    with pytest.raises(DataError, match=r"row 4, 'messages'\[0\]\.content\[0\]: image URLs are not fetched"):
        sample_of(url, 4, text_side)
