"""RL rollouts of a vision-language policy (issue 68): a row with images becomes a trajectory whose prompt holds
each image's pad tokens and whose images are the image processor's; the engine's turns carry them; a tool
that returns an image adds it for the next turn; bad rows stop the run at start-up, naming row and field."""

import json
import os
import random
import textwrap
from concurrent.futures import Future

import datasets
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from rl2.chat.tool_parsers import get_tool_parser
from rl2.config import DataConfig
from rl2.data.conversations import RLDataset
from rl2.data.image_rows import IMAGE_ROW
from rl2.data.rows import Columns, DataError
from rl2.engines import Generation, SamplingParams
from rl2.rollout.env import Env
from rl2.rollout.images import RolloutImages
from rl2.rollout.multi_turn import Pause, ToolCalling, continue_rollout, new_trajectories, rollout
from rl2.rollout.trajectory import Trajectory
from rl2.testing.vision_task import COLOURS, QUADRANTS, draw_shapes, write_task
from rl2.vision.image_inputs import ImageInputs
from rl2.vision.inputs import IMAGE_PAD, build_vision_sample, image_pad_id
from scripted_engine import ScriptedEngine

COLUMNS = Columns(image_key="images")

TOOL_ENV = textwrap.dedent(
    """
    from PIL import Image

    def interact(messages):
        if "look" in messages[-1]["content"]:
            return [{"role": "user", "content": [{"type": "text", "text": "here:"},
                                                 {"type": "image", "image": Image.new("RGB", (84, 56), (0, 0, 255))}]}]
        return []

    def reward_fn(messages, answer):
        return float(messages[-1]["content"].strip() == answer)
    """
)


NATIVE_TOOL_ENV = textwrap.dedent(
    """
    from PIL import Image

    def show(colour: str):
        \"\"\"Show a square of a colour.

        Args:
            colour: the colour's name
        \"\"\"
        return Image.new("RGB", (56, 56), (255, 0, 0) if colour == "red" else (0, 0, 0))

    TOOLS = [show]

    def reward_fn(messages, answer):
        return 0.0
    """
)


class RecordingEngine(ScriptedEngine):
    """A scripted engine that keeps every `Turn` it was given (request index, turn), one request at a time."""

    def generate_turns(self, turns, params, on_generation, max_turns):
        self.turns = []
        for index, turn in enumerate(turns):
            for _ in range(max_turns):
                turn = turn.result() if isinstance(turn, Future) else turn
                if turn is None:
                    break
                self.turns.append((index, turn))
                generation = self.generate([turn.prompt], params)[0]
                turn = on_generation(index, generation)
                if turn is None:
                    break


@pytest.fixture(scope="module")
def tokenizer(vlm_dir):
    return AutoTokenizer.from_pretrained(vlm_dir)


@pytest.fixture(scope="module")
def images(vlm_dir, tokenizer):
    images = RolloutImages.for_model(vlm_dir, DataConfig(), tokenizer)
    yield images
    images.close()


@pytest.fixture
def rows(tmp_path) -> list[dict]:
    red, green = str(tmp_path / "red.png"), str(tmp_path / "green.png")
    Image.new("RGB", (56, 56), (220, 30, 30)).save(red)
    Image.new("RGB", (112, 56), (30, 200, 40)).save(green)
    return [
        {"messages": [{"role": "user", "content": "<image> which colour?"}], "images": [red], "answer": "red"},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"},
                                                   {"type": "image_url", "image_url": {"url": red}}]}],
         "images": [green], "answer": "green"},
        {"messages": [{"role": "user", "content": "no image here"}], "images": [], "answer": "none"},
    ]


def dataset(rows, tokenizer) -> RLDataset:
    return RLDataset(datasets.Dataset.from_list([{**row, "messages": json.dumps(row["messages"])} for row in rows]),
                     tokenizer, None, columns=COLUMNS)


def params(new_tokens=8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=new_tokens)


def test_an_rl_row_with_images_becomes_a_trajectory_with_the_images_build_vision_sample_makes(rows, tokenizer, images):
    data = dataset(rows, tokenizer)
    prompts = images.prepare([data[i] for i in range(len(data))])
    assert all(IMAGE_ROW not in prompt for prompt in prompts)
    engine = RecordingEngine(tokenizer, lambda text: "red")
    trajectories = rollout(engine, None, tokenizer, prompts, 2, params(), images=images)
    pad = image_pad_id(tokenizer)
    for i, row in enumerate(rows[:2]):
        expected = build_vision_sample(row, i, tokenizer, images.processing.image_processor, add_generation_prompt=True)
        patches = (expected["image_grid_thw"].prod(-1) // 4).sum().item()  # merge size 2: 4 patches a token
        for trajectory in trajectories[2 * i:2 * i + 2]:
            prompt_ids = trajectory.token_ids[:len(prompts[i]["prompt_ids"])]
            assert prompt_ids == expected["input_ids"].tolist()
            assert prompt_ids.count(pad) == patches
            assert torch.equal(trajectory.images.pixel_values, expected["pixel_values"])
            assert torch.equal(trajectory.images.image_grid_thw, expected["image_grid_thw"])
            assert trajectory.messages[-1] == {"role": "assistant", "content": "red"}
    assert trajectories[0].images.count == 1 and trajectories[2].images.count == 2
    assert trajectories[4].images is None and pad not in trajectories[4].token_ids  # the text-only row
    assert IMAGE_PAD in trajectories[0].messages[0]["content"]  # the messages show where the image was
    # the engine's turns carry each prompt's images, the prompt's pad tokens stand for them
    assert len(engine.turns) == 6
    for index, turn in engine.turns:
        assert turn.images is trajectories[index].images
        assert turn.prompt == trajectories[index].token_ids[:len(turn.prompt)]


def test_an_image_pad_token_the_policy_writes_ends_the_turn_before_it_and_leaves_the_episode_out(rows, tokenizer, images):
    """The model's forward puts an image's features at every image-pad token: one the policy wrote would stand
    for no image and fail the trainer's forward."""
    prompts = images.prepare([dataset(rows, tokenizer)[i] for i in (0, 2)])
    engine = RecordingEngine(tokenizer, lambda text: f"red{IMAGE_PAD}blue")
    trajectories = rollout(engine, None, tokenizer, prompts, 1, params(), images=images)
    pad = image_pad_id(tokenizer)
    for trajectory, prompt in zip(trajectories, prompts):
        response = trajectory.token_ids[len(prompt["prompt_ids"]):]
        assert response == tokenizer("red", add_special_tokens=False)["input_ids"]
        assert trajectory.token_ids.count(pad) == prompt["prompt_ids"].count(pad)
        assert trajectory.errors == ["the policy generated an image-pad token"] and trajectory.done
        assert len(trajectory.logprobs) == len(trajectory.action_mask) == len(trajectory.token_ids)


def test_a_prompts_images_are_processed_once_for_its_whole_group(rows, tokenizer, images):
    prompt = images.prepare([dataset(rows, tokenizer)[0]])[0]
    group = new_trajectories([prompt], 4)
    assert all(trajectory.images is group[0].images for trajectory in group)


def test_a_text_model_reads_rows_as_before(rows, tokenizer):
    plain = rows[2:]
    with_columns = dataset(plain, tokenizer)[0]
    without = RLDataset(datasets.Dataset.from_list(plain), tokenizer, None)[0]
    assert IMAGE_ROW not in with_columns and with_columns["prompt_ids"] == without["prompt_ids"]


def test_a_missing_image_file_stops_the_run_at_start_up_naming_row_and_field(rows, tokenizer, tmp_path):
    rows[1]["images"] = [str(tmp_path / "gone.png")]
    with pytest.raises(DataError, match=r"row 2, 'images'\[0\]: image file not found: .*gone.png"):
        dataset(rows, tokenizer)
    rows[1]["images"] = [rows[0]["images"][0]]
    rows[1]["messages"][0]["content"][2]["image_url"]["url"] = "missing.png"
    with pytest.raises(DataError, match=r"row 2, 'messages'\[0\].content\[2\]: image file not found"):
        dataset(rows, tokenizer)


def test_an_image_count_that_does_not_match_the_placeholders_stops_the_run_at_start_up(rows, tokenizer):
    rows[0]["images"] = rows[0]["images"] * 2
    with pytest.raises(DataError, match=r"row 1: 'images' has 2 image\(s\) but the messages have 1 <image>"):
        dataset(rows, tokenizer)


def test_a_tool_that_returns_an_image_adds_it_to_the_next_turns_images(rows, tokenizer, images, tmp_path):
    path = tmp_path / "env.py"
    path.write_text(TOOL_ENV)
    prompts = images.prepare([dataset(rows, tokenizer)[0]])
    engine = RecordingEngine(tokenizer, lambda text: "blue" if "here:" in text else "look")
    with Env(str(path), need_interact=True) as env:
        [trajectory] = rollout(engine, env, tokenizer, prompts, 1, params(), max_turns=2, images=images)
    first, second = (turn for _, turn in engine.turns)
    assert first.images.count == 1 and second.images.count == 2
    assert trajectory.images is second.images and trajectory.turns == 2
    tool_image = images.tool_messages([{"role": "user", "content": [
        {"type": "image", "image": Image.new("RGB", (84, 56), (0, 0, 255))}]}], "test")[1]
    assert torch.equal(second.images.image_grid_thw, torch.cat([first.images.image_grid_thw, tool_image.image_grid_thw]))
    assert torch.equal(second.images.pixel_values, torch.cat([first.images.pixel_values, tool_image.pixel_values]))
    pad = image_pad_id(tokenizer)
    tokens_per_image = (second.images.image_grid_thw.prod(-1) // 4).tolist()
    assert second.prompt.count(pad) == sum(tokens_per_image)
    assert trajectory.messages[2]["content"].startswith("here:") and IMAGE_PAD in trajectory.messages[2]["content"]
    generated = sum(len(tokenizer(word, add_special_tokens=False)["input_ids"]) + 1 for word in ("look", "blue"))
    assert trajectory.action_mask.count(1) == generated  # the two replies and their <|im_end|>, no image token


def test_per_turn_each_turns_sequence_holds_the_images_of_the_conversation_so_far(rows, tokenizer, images, tmp_path):
    """rollout.trajectory_format=per_turn: the second turn's sequence is the whole conversation rendered again, the
    prompt's image and the tool's both expanded; `turn_images` says which of the trajectory's images each turn's
    sequence holds (the first 1, then 2; for a prompt without images none, then the first), and the engine's turns
    carry exactly those. The state round-trips through a checkpoint."""
    path = tmp_path / "env.py"
    path.write_text(TOOL_ENV)
    prompts = images.prepare([dataset(rows, tokenizer)[i] for i in (0, 2)])
    engine = RecordingEngine(tokenizer, lambda text: "blue" if "here:" in text else "look")
    with Env(str(path), need_interact=True) as env:
        trajectories = rollout(engine, env, tokenizer, prompts, 1, params(), max_turns=2, images=images, per_turn=True)
    pad = image_pad_id(tokenizer)
    tool_image = images.tool_messages([{"role": "user", "content": [
        {"type": "image", "image": Image.new("RGB", (84, 56), (0, 0, 255))}]}], "test")[1]
    for trajectory, prompt, expected_counts in zip(trajectories, prompts, ([1, 2], [0, 1])):
        assert trajectory.errors == [] and trajectory.turns == 2 and len(trajectory.turn_starts) == 2
        assert trajectory.turn_images == [[0, count] for count in expected_counts]
        expected = ImageInputs.concat([prompt.get("images"), tool_image])
        assert torch.equal(trajectory.images.pixel_values, expected.pixel_values)
        assert torch.equal(trajectory.images.image_grid_thw, expected.image_grid_thw)
        start = trajectory.turn_starts[1]
        first, second = trajectory.token_ids[:start], trajectory.token_ids[start:]
        assert first[:len(prompt["prompt_ids"])] == prompt["prompt_ids"]
        per_image = images.counts(trajectory.images)
        assert first.count(pad) == sum(per_image[:expected_counts[0]]) and second.count(pad) == sum(per_image)
        assert second[:len(prompt["prompt_ids"]) - 1] == prompt["prompt_ids"][:-1]  # the conversation again
    turns = [turn for _, turn in engine.turns]
    assert [turn.images.count if turn.images else 0 for turn in turns] == [1, 2, 0, 1]  # one request at a time
    assert turns[1].prompt == trajectories[0].token_ids[trajectories[0].turn_starts[1]:][:len(turns[1].prompt)]
    restored = Trajectory.from_dict(json.loads(json.dumps(trajectories[0].state())))
    assert restored.turn_images == [[0, 1], [0, 2]] and restored.turn_starts == trajectories[0].turn_starts


def test_a_native_tool_that_returns_a_pil_image_adds_it_to_the_next_turns_images(rows, tokenizer, images, tmp_path):
    path = tmp_path / "env.py"
    path.write_text(NATIVE_TOOL_ENV)
    prompts = images.prepare([dataset(rows, tokenizer)[0]])
    call = '<tool_call>{"name": "show", "arguments": {"colour": "red"}}</tool_call>'
    engine = RecordingEngine(tokenizer, lambda text: "r" if "<tool_response>" in text or "tool\n" in text else call)
    with Env(str(path)) as env:
        [trajectory] = rollout(engine, env, tokenizer, prompts, 1, params(256), max_turns=2, images=images,
                               tool_calling=ToolCalling(get_tool_parser("hermes")))
    assert trajectory.errors == [] and trajectory.turns == 2
    first, second = (turn for _, turn in engine.turns)
    assert first.images.count == 1 and second.images.count == 2
    assert second.prompt.count(image_pad_id(tokenizer)) == int((second.images.image_grid_thw.prod(-1) // 4).sum())
    assert trajectory.messages[2]["role"] == "tool" and IMAGE_PAD in trajectory.messages[2]["content"]


def test_a_tool_image_for_a_text_only_policy_is_an_error_of_the_trajectory(rows, tokenizer, tmp_path):
    path = tmp_path / "env.py"
    path.write_text(TOOL_ENV)
    prompt = {"prompt_ids": dataset(rows[2:], tokenizer)[0]["prompt_ids"], "messages": [], "answer": "x"}
    with Env(str(path), need_interact=True) as env:
        [trajectory] = rollout(ScriptedEngine(tokenizer, lambda text: "look"), env, tokenizer, [prompt], 1, params(),
                               max_turns=2)
    assert trajectory.turns == 1 and "not a vision-language model" in trajectory.errors[0]


def test_a_paused_trajectory_with_images_resumes_from_its_checkpoint(rows, tokenizer, images):
    prompt = images.prepare([dataset(rows, tokenizer)[1]])[0]
    [trajectory] = new_trajectories([prompt], 1)
    pause = Pause(ScriptedEngine(tokenizer, lambda text: ""))
    pause.requested.set()

    class Aborting(ScriptedEngine):
        def generate(self, prompts, params, images=None):
            return [Generation(token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="abort", stream=(1, 2))]

    continue_rollout(Aborting(tokenizer, None), None, tokenizer, [trajectory], params(), pause=pause, images=images)
    assert not trajectory.done and trajectory.running.generating_from >= 0
    restored = Trajectory.from_dict(json.loads(json.dumps(trajectory.state())))
    assert torch.equal(restored.images.pixel_values, trajectory.images.pixel_values)
    assert torch.equal(restored.images.image_grid_thw, trajectory.images.image_grid_thw)
    assert restored.token_ids == trajectory.token_ids
    engine = RecordingEngine(tokenizer, lambda text: "green")
    continue_rollout(engine, None, tokenizer, [restored], params(), images=images)
    [(_, turn)] = engine.turns
    assert turn.offset == 2 and torch.equal(turn.images.pixel_values, trajectory.images.pixel_values)
    assert restored.done and restored.messages[-1]["role"] == "assistant"


def test_the_vision_demos_rows_load_as_rl_and_sft_rows_whose_answers_are_one_token(tmp_path, tokenizer, images):
    write_task(str(tmp_path), rows=24, test_rows=8)
    train = RLDataset(str(tmp_path / "train.jsonl"), tokenizer, None, columns=COLUMNS)
    assert len(train) == 24 and len(RLDataset(str(tmp_path / "test.jsonl"), tokenizer, None, columns=COLUMNS)) == 8
    for prompt in images.prepare([train[i] for i in range(len(train))]):
        assert prompt["images"].count == 1 and prompt["images"].image_grid_thw.tolist() == [[1, 4, 4]]
        assert prompt["prompt_ids"].count(image_pad_id(tokenizer)) == 4  # 56x56: one token a quadrant
        assert len(tokenizer(prompt["answer"], add_special_tokens=False)["input_ids"]) == 1
    sft = [json.loads(line) for line in open(tmp_path / "sft.jsonl")]
    rl = [json.loads(line) for line in open(tmp_path / "train.jsonl")]
    assert [row["messages"][-1]["content"] for row in sft] == [row["answer"] for row in rl]  # clean labels by default
    env_path = os.path.join(os.path.dirname(__file__), "..", "envs", "demo_vision.py")
    with Env(env_path) as env:
        results = env.rewards([[{"role": "assistant", "content": " 3 "}], [{"role": "assistant", "content": "3."}]],
                              ["3", "3"])
    assert [result.value for result in results] == [1.0, 0.0]


def test_the_vision_demos_images_show_as_many_shapes_as_the_answer_says():
    rng = random.Random(0)
    for count in range(1, 5):
        image = draw_shapes(rng, count, "b")
        quadrants = [image.crop((x, y, x + 28, y + 28)).getcolors() for x, y in QUADRANTS]
        assert sum(len(colours) > 1 for colours in quadrants) == count
        assert {colour for colours in quadrants for _, colour in colours} <= {(255, 255, 255), COLOURS["b"]}


def test_a_reset_observation_keeps_the_prompts_image_pads_expanded(rows, tokenizer, images, tmp_path):
    path = tmp_path / "env.py"
    path.write_text(textwrap.dedent(
        '''
        class Hints:
            def reset(self, messages, answer):
                return "Hint: look closely."

            def look(self) -> str:
                """Look again."""
                return "nothing new"

            def reward(self) -> float:
                return 1.0

        ENVIRONMENT = Hints
        '''))
    prompts = images.prepare([dataset(rows, tokenizer)[0]])
    engine = RecordingEngine(tokenizer, lambda text: "r")
    with Env(str(path)) as env:
        [trajectory] = rollout(engine, env, tokenizer, prompts, 1, params(), images=images)
    [(_, turn)] = engine.turns
    assert trajectory.messages[1] == {"role": "user", "content": "Hint: look closely."}
    assert turn.prompt.count(image_pad_id(tokenizer)) == 4 and turn.images is trajectory.images
    through_image = len(prompts[0]["prompt_ids"]) - prompts[0]["prompt_ids"][::-1].index(image_pad_id(tokenizer))
    assert turn.prompt[:through_image] == prompts[0]["prompt_ids"][:through_image]


def test_a_tool_image_past_the_length_limit_is_left_out_whole(rows, tokenizer, images, tmp_path):
    path = tmp_path / "env.py"
    path.write_text(TOOL_ENV)
    prompts = images.prepare([dataset(rows, tokenizer)[0]])
    look = len(tokenizer("look", add_special_tokens=False)["input_ids"]) + 1
    engine = RecordingEngine(tokenizer, lambda text: "blue" if "here:" in text else "look")
    with Env(str(path), need_interact=True) as env:
        [trajectory] = rollout(engine, env, tokenizer, prompts, 1, params(), max_turns=2, images=images,
                               max_length=len(prompts[0]["prompt_ids"]) + look + 8)  # the tool's image needs 6 + 8
    assert trajectory.truncated and trajectory.done and trajectory.turns == 1 and not trajectory.errors
    assert trajectory.images.count == 1 and trajectory.token_ids.count(image_pad_id(tokenizer)) == 4
    assert len(trajectory.token_ids) <= len(prompts[0]["prompt_ids"]) + look + 8


def test_a_prompt_with_images_keeps_its_tool_schemas(rows, vlm_dir, images):
    """Native function calling with images: the prompt the engine sees is rendered with the row's tools, as a
    text prompt is (a prompt rebuilt for its images once lost them)."""
    from rl2.testing.chat_templates import CHATML_TOOLS_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    schema = {"type": "function", "function": {"name": "zoom_in", "description": "Zoom into the image.",
                                               "parameters": {"type": "object", "properties": {}}}}
    with_tools = RolloutImages.for_model(vlm_dir, DataConfig(), tokenizer)
    try:
        prompt = with_tools.prepare([{**dataset(rows, tokenizer)[0], "tools": [schema]}])[0]
    finally:
        with_tools.close()
    expected = build_vision_sample(rows[0], 0, tokenizer, images.processing.image_processor,
                                   add_generation_prompt=True, tools=[schema])["input_ids"].tolist()
    assert prompt["prompt_ids"] == expected
    assert "zoom_in" in tokenizer.decode(prompt["prompt_ids"])
    assert prompt["prompt_ids"].count(image_pad_id(tokenizer)) == prompt["images"].image_grid_thw.prod(-1).item() // 4
