"""Agents of a vision-language model over the OpenAI API (issue 68): the real `openai` client sends `image_url`
parts with data URIs to rl2's server over the `hf` engine on a tiny random Qwen2.5-VL; the prompt tokens are rl2's
own rendering of the messages (`build_vision_sample`), a later turn with another image continues the sequence,
the images reach the engine and the trajectory, and an http URL is refused naming the part."""

import base64
import io
import json
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from rl2.chat.tool_parsers import get_tool_parser
from rl2.engines import HFEngine, SamplingParams
from rl2.rollout.agent_rollout import AgentFile, agent_rollout
from rl2.serve.openai_server import OpenAIServer
from rl2.testing.tiny import sharpen_weights
from rl2.testing.tiny_vlm import build_tiny_image_processor, build_tiny_vlm, build_tiny_vlm_tokenizer
from rl2.vision.inputs import build_vision_sample, image_pad_id
from rl2.vision.processing import ImageProcessing

openai = pytest.importorskip("openai")

AGENT = '''
    import json


    async def run(row, client):
        messages = list(row["messages"])
        first = await client.chat.completions.create(model="rl2", messages=messages, max_tokens=5,
                                                     extra_body={"return_token_ids": True})
        messages.append({"role": "assistant", "content": first.choices[0].message.content})
        messages.append({"role": "user", "content": [{"type": "text", "text": "and now?"},
                                                     {"type": "image_url", "image_url": {"url": row["second"]}}]})
        second = await client.chat.completions.create(model="rl2", messages=messages, max_tokens=5,
                                                      extra_body={"return_token_ids": True})
        with open(row["out"], "w") as f:
            json.dump({"prompts": [first.model_extra["prompt_token_ids"], second.model_extra["prompt_token_ids"]],
                       "completions": [first.choices[0].model_extra["token_ids"],
                                       second.choices[0].model_extra["token_ids"]],
                       "messages": messages}, f)
        return 1.0
'''

REMOTE = '''
    async def run(row, client):
        try:
            await client.chat.completions.create(model="rl2", messages=[{"role": "user", "content": [
                {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}]}])
        except Exception as error:
            with open(row["out"], "w") as f:
                f.write(f"{getattr(error, 'status_code', None)} {error}")
        return 1.0
'''


def data_uri(seed: int, size=(56, 84)) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    tokenizer = build_tiny_vlm_tokenizer()
    sharpen_weights(build_tiny_vlm(tokenizer, family="qwen2_5_vl")).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    build_tiny_image_processor("qwen2_5_vl").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(vlm_dir):
    return AutoTokenizer.from_pretrained(vlm_dir)


@pytest.fixture(scope="module")
def server(vlm_dir, tokenizer):
    server = OpenAIServer(tokenizer, image_processing=ImageProcessing.from_pretrained(vlm_dir))
    yield server
    server.close()


def agent_file(tmp_path, source: str) -> AgentFile:
    path = tmp_path / "agent.py"
    path.write_text(textwrap.dedent(source))
    return AgentFile(str(path))


def test_image_parts_render_as_rl2_renders_them_and_reach_the_engine_and_trajectory(server, vlm_dir, tokenizer,
                                                                                  tmp_path):
    engine = HFEngine(vlm_dir, tokenizer, torch.device("cpu"))
    processor = build_tiny_image_processor("qwen2_5_vl")
    first_messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(1)}},
                                                   {"type": "text", "text": "what is this?"}]}]
    out = tmp_path / "seen.json"
    row = {"messages": first_messages, "prompt_ids": [1], "row": {"second": data_uri(2, (84, 56)), "out": str(out)}}
    (trajectory,) = agent_rollout(server, engine, agent_file(tmp_path, AGENT), tokenizer, get_tool_parser("hermes"),
                                  [row], 1, SamplingParams(temperature=0.0, max_new_tokens=5), 8, 4096)
    assert not trajectory.errors and trajectory.reward == 1.0 and trajectory.turns == 2
    assert trajectory.agent_stats["sequences"] == 1  # the second request continued the first
    seen = json.loads(out.read_text())
    (first, second), (first_tokens, second_tokens) = seen["prompts"], seen["completions"]
    expected = build_vision_sample({"messages": first_messages}, 0, tokenizer, processor, add_generation_prompt=True)
    assert first == expected["input_ids"].tolist()  # rl2's own rendering, image pads expanded
    assert second[: len(first) + len(first_tokens)] == first + first_tokens  # the sampled ids, not re-encoded
    whole = build_vision_sample({"messages": seen["messages"]}, 0, tokenizer, processor, add_generation_prompt=True)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    last_user = max(i for i, t in enumerate(whole["input_ids"].tolist()) if t == start and
                    i < len(whole["input_ids"]) - 3)
    tail = whole["input_ids"].tolist()[last_user:]
    assert second[-len(tail):] == tail  # the new message with its image, as rl2 renders it
    assert trajectory.token_ids == second + second_tokens
    pad = image_pad_id(tokenizer)
    assert trajectory.images.count == 2 and trajectory.token_ids.count(pad) == int(
        (trajectory.images.image_grid_thw.prod(-1) // 4).sum())
    assert torch.equal(trajectory.images.pixel_values, whole["pixel_values"])
    assert torch.equal(trajectory.images.image_grid_thw, whole["image_grid_thw"])
    # the log-probs the engine recorded are the model's on the trajectory's tokens with its images
    model = engine.model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([trajectory.token_ids]),
                       mm_token_type_ids=(torch.tensor([trajectory.token_ids]) == pad).long(),
                       pixel_values=trajectory.images.pixel_values,
                       image_grid_thw=trajectory.images.image_grid_thw).logits[0]
    targets = torch.tensor(trajectory.token_ids[1:])[:, None]
    logprobs = torch.log_softmax(logits[:-1].float(), -1).gather(-1, targets)[:, 0]
    generated = [i for i, m in enumerate(trajectory.action_mask) if m]
    got = torch.tensor([trajectory.logprobs[i] for i in generated])
    assert (logprobs[[i - 1 for i in generated]] - got).abs().max() < 1e-4


def test_an_image_url_that_is_not_a_data_uri_is_refused_naming_the_part(server, vlm_dir, tokenizer, tmp_path):
    engine = HFEngine(vlm_dir, tokenizer, torch.device("cpu"))
    out = tmp_path / "error.txt"
    row = {"messages": [{"role": "user", "content": "hi"}], "prompt_ids": [1], "row": {"out": str(out)}}
    (trajectory,) = agent_rollout(server, engine, agent_file(tmp_path, REMOTE), tokenizer, get_tool_parser("hermes"),
                                  [row], 1, SamplingParams(max_new_tokens=4), 8, 4096)
    error = out.read_text()
    assert error.startswith("400 ") and "messages[0].content[1]" in error and "data URI" in error
    assert trajectory.errors == ["the agent made no request"]


def test_a_turns_images_survive_a_snapshot_and_the_rest_of_a_cut_turn():
    """A paused agent request with images: its snapshot is JSON (images saved), restores equal, and the rest
    of a cut turn keeps its images; a text turn's state has no images key (as before)."""
    from rl2.engines import Generation, Turn
    from rl2.serve.engine_slots import _rest, _same_turn, _turn, _turn_state
    from rl2.vision.image_inputs import ImageInputs

    images = ImageInputs(torch.randn(16, 1176), torch.tensor([[1, 4, 4]]))
    turn = Turn([1, 2, 3, 4], 8, (5, 6), 0, images)
    restored = _turn(json.loads(json.dumps(_turn_state(turn))))
    assert _same_turn(restored, turn) and restored.images is not images
    other = Turn([1, 2, 3, 4], 8, (5, 6), 0, ImageInputs(images.pixel_values + 1, images.image_grid_thw))
    assert not _same_turn(other, turn) and not _same_turn(Turn([1, 2, 3, 4], 8, (5, 6)), turn)
    rest = _rest(turn, [(Generation([9, 9], [-1.0, -1.0], "abort", None, (5, 6)), 0)])
    assert rest.prompt == [1, 2, 3, 4, 9, 9] and rest.offset == 2 and rest.images is images
    assert "images" not in _turn_state(Turn([1], 4)) and _turn(_turn_state(Turn([1], 4))) == Turn([1], 4)


def test_an_agent_that_made_no_request_for_an_image_row_keeps_no_image_pad_tokens(tokenizer):
    """Such a trajectory is the prompt alone, left out of training but still scored by the models: the prompt's
    image pads stand for images never processed, so they are dropped (a text row keeps all its tokens)."""
    from rl2.data.image_rows import IMAGE_ROW
    from rl2.rollout.agent_rollout import agent_trajectory
    from rl2.serve.session import AgentSession

    pad = image_pad_id(tokenizer)
    row = {"prompt_ids": [5, pad, 6], "messages": [], IMAGE_ROW: {"row": {}}}
    trajectory = agent_trajectory(AgentSession(tokenizer, get_tool_parser("hermes")), row, 0, 0)
    assert trajectory.token_ids == [5, 6] and trajectory.errors == ["the agent made no request"] and trajectory.excluded
    text = agent_trajectory(AgentSession(tokenizer, get_tool_parser("hermes")), {"prompt_ids": [5, 7, 6], "messages": []},
                            0, 0)
    assert text.token_ids == [5, 7, 6]
