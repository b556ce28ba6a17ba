"""RL2's data keys: `data.messages_key`, and raw prompts with `data.apply_chat_template=false` (the
`data.prompt_key` text as the model's input, tools appended as plain text), from the rows to a PPO step."""

import copy
import json
import textwrap

import datasets
import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from conftest import run_python, tokenize_prompt
from rl2.config import ConfigError, load_config
from rl2.config_checks import check_config
from rl2.data.conversations import PairDataset, RLDataset, SFTDataset
from rl2.data.rows import Columns, DataError, load_rows, validate_rows
from rl2.engines import SamplingParams
from rl2.metrics import read_metrics
from rl2.rollout.env import Env
from rl2.rollout.multi_turn import assign_rewards, observation_tokens, rollout
from scripted_engine import ScriptedEngine

RAW = Columns(apply_chat_template=False)
PROMPT = "A conversation between User and Assistant.\nUser: What is 6 x 7?\nAssistant: <think>"
TOOL_TEXT = "\n\n<information>6 x 7 = 42</information>\n\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ----------------------------------------------------------------------------------------------
# data


def test_raw_prompt_is_tokenized_as_is(tokenizer):
    """No chat template and no special token added, even by a tokenizer that adds a BOS by default;
    one the text holds stays."""
    with_bos = copy.deepcopy(tokenizer)
    bos = with_bos.convert_tokens_to_ids("<|endoftext|>")
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    assert with_bos(PROMPT)["input_ids"][0] == bos  # the default would add it
    texts = [PROMPT, "<|endoftext|>" + PROMPT]
    rows = datasets.Dataset.from_list([{"prompt": text, "answer": "42", "messages": None} for text in texts])
    dataset = RLDataset(rows, with_bos, None, columns=RAW)
    for i, text in enumerate(texts):
        assert dataset[i]["prompt_ids"] == ids(with_bos, text)
        assert dataset[i]["messages"] == [{"role": "user", "content": text}]
        assert dataset[i]["answer"] == "42"
    assert dataset[0]["prompt_ids"][0] != bos and dataset[1]["prompt_ids"][0] == bos
    assert tokenizer.decode(dataset[0]["prompt_ids"]) == PROMPT  # no template around it


def test_raw_prompts_longer_than_max_length_are_dropped(tokenizer):
    rows = datasets.Dataset.from_list([{"prompt": "word " * n, "answer": n} for n in (1, 50, 2)])
    dataset = RLDataset(rows, tokenizer, max_length=len(ids(tokenizer, "word " * 2)), columns=RAW)
    assert [dataset[i]["answer"] for i in range(len(dataset))] == [1, 2] and dataset.num_skipped == 1


def test_custom_messages_key(tmp_path, tokenizer):
    user, assistant = {"role": "user", "content": "What is 6 x 7?"}, {"role": "assistant", "content": "42"}
    columns = Columns(messages_key="conversation")
    rl = write_jsonl(tmp_path / "rl.jsonl", [{"conversation": [user], "answer": "42"}])
    item = RLDataset(rl, tokenizer, None, columns=columns)[0]
    assert item["prompt_ids"] == tokenize_prompt([user], tokenizer) and item["messages"] == [user]
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"conversation": [user, assistant]}])
    assert len(SFTDataset(sft, tokenizer, None, columns=columns)[0]["input_ids"]) > 0
    pair = write_jsonl(tmp_path / "pair.jsonl", [{"conversation": [user], "chosen": "42", "rejected": "41"}])
    assert set(PairDataset(pair, tokenizer, None, columns=columns)[0]) == {"chosen", "rejected"}
    with pytest.raises(DataError, match=r"missing column 'messages' \(data\.messages_key\)"):
        RLDataset(rl, tokenizer, None)  # the default key finds no such column


@pytest.mark.parametrize(
    "columns, rows, message",
    [
        (RAW, [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 1}, {"answer": 1}],
         "train.jsonl, row 3 has no 'prompt' column (data.prompt_key, used because data.apply_chat_template=false)"),
        (Columns(apply_chat_template=False, prompt_key="question"), [{"question": "a", "answer": 1}, {"answer": 1}],
         "train.jsonl, row 2 has no 'question' column (data.prompt_key, used because data.apply_chat_template=false)"),
        (Columns(messages_key="chat"), [{"chat": [{"role": "user", "content": "a"}], "answer": 1}, {"answer": 1}],
         "train.jsonl, row 2 has no 'chat' column (data.messages_key)"),
        (RAW, [{"prompt": "a", "answer": 1}, {"prompt": "", "answer": 1}],
         "train.jsonl, row 2, field 'prompt': expected the raw prompt text (a non-empty string"),
        (RAW, [{"prompt": [{"role": "user", "content": "a"}], "answer": 1}],
         "row 1, field 'prompt': expected the raw prompt text (a non-empty string, data.apply_chat_template=false), "
         "got list; a column of messages is read with data.apply_chat_template=true data.messages_key=prompt"),
        (RAW, [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": None}],
         "train.jsonl, row 2, field 'answer': missing"),
        (RAW, [{"messages": [{"role": "user", "content": "a"}], "answer": 1}],
         "train.jsonl: missing column 'prompt' (data.prompt_key, used because data.apply_chat_template=false) needed "
         "for rl data; columns present: ['messages', 'answer']; to read the 'messages' column through the chat "
         "template, set data.apply_chat_template=true"),
        (Columns(), [{"question": "a", "answer": 1}],  # a 'prompt' column would be read as one user message
         "train.jsonl: missing column 'messages' (data.messages_key) needed for rl data; columns present: "
         "['question', 'answer']; a column of prompt text is also read, as one user message: "
         "data.prompt_key=<its name> (now 'prompt')"),
    ],
    ids=["row-without-prompt", "custom-prompt-key", "row-without-messages", "empty-prompt", "messages-in-prompt",
         "null-answer", "no-prompt-column", "no-messages-column"],
)
def test_column_errors_name_the_row_and_key(tmp_path, tokenizer, columns, rows, message):
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError) as error:
        validate_rows(load_rows(path), "rl", "train.jsonl", columns)
    assert message in str(error.value)
    with pytest.raises(DataError):  # the dataset validates at construction, with the path as its source
        RLDataset(path, tokenizer, None, columns=columns)


def test_raw_prompts_are_for_rl_only(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(ValueError, match="for RL data only"):
        SFTDataset(path, tokenizer, None, columns=RAW)
    base = ["data.path=rows.jsonl", "actor.model_name=Qwen/Qwen2.5-0.5B", "critic.model_name=Qwen/Qwen2.5-0.5B",
            "rollout.env_path=envs/math_reward.py", "data.apply_chat_template=false"]
    for command in ("sft", "rm", "dpo", "search"):
        with pytest.raises(ConfigError, match="data.apply_chat_template=false is not supported") as error:
            check_config(load_config(base), command)
        assert "messages" in str(error.value)
    with pytest.raises(ConfigError, match="RL2's raw mode reads prompt / response columns; rl2 does not"):
        check_config(load_config(base), "sft")
    check_config(load_config(base), "ppo")
    check_config(load_config([*base, "filter.output=out.jsonl"]), "filter")


# ----------------------------------------------------------------------------------------------
# rollouts

ENV = textwrap.dedent(
    """
    import json

    def interact(messages):
        if "<search>" in messages[-1]["content"]:
            return [{"role": "tool", "content": TOOL_TEXT}]
        return []

    def reward_fn(messages, answer):
        with open(LOG, "a") as log:
            log.write(json.dumps(messages) + "\\n")
        return float(messages[-1]["content"].endswith(answer))
    """
)


@pytest.fixture
def env(tmp_path):
    path = tmp_path / "env.py"
    log = tmp_path / "messages.jsonl"
    path.write_text(f"LOG = {str(log)!r}\nTOOL_TEXT = {TOOL_TEXT!r}\n" + ENV)
    with Env(str(path), timeout=5.0, need_interact=True) as env:
        env.log = log
        yield env


def raw_prompt(tokenizer) -> dict:
    rows = datasets.Dataset.from_list([{"prompt": PROMPT, "answer": "42"}])
    return RLDataset(rows, tokenizer, None, columns=RAW)[0]


def test_one_turn_raw_rollout(tokenizer, env):
    engine = ScriptedEngine(tokenizer, lambda text: " 6 x 7 is 42</think> 42")
    prompt = raw_prompt(tokenizer)
    (trajectory,) = rollout(engine, env, tokenizer, [prompt], 1, SamplingParams(), max_turns=1,
                            apply_chat_template=False)
    generated = ids(tokenizer, " 6 x 7 is 42</think> 42") + [tokenizer.eos_token_id]
    assert trajectory.token_ids == ids(tokenizer, PROMPT) + generated
    assert trajectory.action_mask == [0] * len(prompt["prompt_ids"]) + [1] * len(generated)
    assign_rewards(env, [trajectory])
    assert trajectory.reward == 1.0
    (seen,) = [json.loads(line) for line in env.log.read_text().splitlines()]
    assert seen == [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": " 6 x 7 is 42</think> 42"}]


@pytest.mark.parametrize("end", ["eos", "stop"])
def test_two_turn_raw_rollout_is_token_exact(tokenizer, env, end):
    """Prompt, first generation, the tool's text as is, second generation: each piece's own tokens,
    nothing re-tokenised, no template (a turn may end on a stop string, as `</search>` does)."""
    first, second = " I should look it up. <search>6 x 7</search>", "</think> The answer is 42"
    engine = ScriptedEngine(tokenizer, lambda text: second if "<information>" in text else first, end=end)
    prompt = raw_prompt(tokenizer)
    (trajectory,) = rollout(engine, env, tokenizer, [prompt], 1, SamplingParams(), max_turns=3,
                            apply_chat_template=False)
    eos = [tokenizer.eos_token_id] if end == "eos" else []
    pieces = [(ids(tokenizer, PROMPT), 0), (ids(tokenizer, first) + eos, 1), (ids(tokenizer, TOOL_TEXT), 0),
              (ids(tokenizer, second) + eos, 1)]
    assert trajectory.token_ids == [token for piece, _ in pieces for token in piece]
    assert trajectory.action_mask == [mask for piece, mask in pieces for _ in piece]
    assert trajectory.logprobs == [-0.5 if mask else 0.0 for piece, mask in pieces for _ in piece]
    assert engine.calls[1][0] == trajectory.token_ids[: len(engine.calls[1][0])]  # the model continued from there
    assert len(engine.calls[1][0]) == sum(len(piece) for piece, _ in pieces[:3])
    assert trajectory.turns == 2 and not trajectory.truncated
    assign_rewards(env, [trajectory])
    (seen,) = [json.loads(line) for line in env.log.read_text().splitlines()]
    assert seen == [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": first},
        {"role": "tool", "content": TOOL_TEXT},
        {"role": "assistant", "content": second},
    ]
    assert trajectory.messages == seen and trajectory.reward == 1.0


def test_raw_observation_concatenates_the_messages(tokenizer):
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "<search>q</search>"}]
    new = [{"role": "tool", "content": "\n<information>a</information>"}, {"role": "user", "content": "\nGo on: "}]
    so_far = ids(tokenizer, PROMPT + "<search>q</search>")
    raw = observation_tokens(tokenizer, so_far, messages, new, apply_chat_template=False)
    assert raw == ids(tokenizer, "\n<information>a</information>\nGo on: ")
    assert raw != observation_tokens(tokenizer, so_far, messages, new)  # the template's rendering


# ----------------------------------------------------------------------------------------------
# a PPO run

PPO_ENV = """
def interact(messages):
    return [{"role": "tool", "content": TOOL_TEXT}] if len(messages) == 2 else []


def reward_fn(messages, answer):
    roles = [m["role"] for m in messages]
    tool = messages[2:3]
    if (roles not in (["user", "assistant"], ["user", "assistant", "tool", "assistant"])
            or not messages[0]["content"].startswith("Q: what follows")
            or tool not in ([], [{"role": "tool", "content": TOOL_TEXT}])):
        raise ValueError(f"unexpected messages: {messages}")
    return float(len(messages[-1]["content"]) % 2)
"""

PPO_CHECK = """
import sys
from rl2 import PPOTrainer, load_config

trainer = PPOTrainer(load_config(sys.argv[1:]))
tokenizer = trainer.tokenizer
prompts = [trainer.train_data[i] for i in range(4)]
for prompt in prompts:
    assert prompt["prompt_ids"] == tokenizer(prompt["messages"][0]["content"], add_special_tokens=False)["input_ids"]
trajectories = trainer.rollout.generate(prompts, trainer.rollout.train_params, 2, seed=0)
tool_ids = tokenizer(TOOL_TEXT, add_special_tokens=False)["input_ids"]
two_turns = [t for t in trajectories if t.turns == 2]
assert two_turns, "no trajectory reached the tool"
for t in two_turns:
    mask = t.action_mask
    start = mask.index(1) + mask[mask.index(1):].index(0)  # after the first generation
    end = start + len(tool_ids)
    assert t.token_ids[start:end] == tool_ids and mask[start:end] == [0] * len(tool_ids)
    assert mask[end] == 1  # the model continues right after the tool's text
    assert t.reward is not None, t.errors
trainer.train()
print("RAW PPO OK")
"""


def test_ppo_step_with_raw_prompts(tiny_model_dir, tmp_path, tokenizer):
    """One PPO step on `{"prompt", "answer"}` rows with data.apply_chat_template=false and a tool turn:
    the prompts are the raw text's tokens, the tool's text is appended as is, the env sees the
    documented messages (its reward_fn raises otherwise, and the step would have no reward)."""
    rows = [{"prompt": f"Q: what follows {n}?\nA:", "answer": str(n + 1)} for n in range(8)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    env_file = tmp_path / "env.py"
    env_file.write_text(f"TOOL_TEXT = {TOOL_TEXT!r}\n" + PPO_ENV)
    # Every even token id stops a generation: turns end early (finish "stop"), so the tool is reached.
    stops = ", ".join(str(i) for i in range(0, len(tokenizer), 2))
    args = [
        f"data.path={data}", "data.test_ratio=0", "data.apply_chat_template=false", "data.prompts_per_rollout=4",
        "data.responses_per_prompt=2", f"actor.model_name={tiny_model_dir}", "actor.dtype=float32",
        "actor.gradient_checkpointing=false", f"actor.save_dir={tmp_path / 'run'}", f"rollout.env_path={env_file}",
        "rollout.max_turns=2", "rollout.dynamic_filtering=false", "rollout.env_workers=0",
        f"rollout.train_sampling_params={{temperature: 1.0, max_new_tokens: 4, stop_token_ids: [{stops}]}}",
        "trainer.total_steps=1", "trainer.disable_wandb=true",
    ]
    result = run_python(["-c", f"TOOL_TEXT = {TOOL_TEXT!r}\n" + PPO_CHECK, *args])
    assert "RAW PPO OK" in result.stdout
    (row,) = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert row["step"] == 1 and "actor/loss" in row and row["reward_errors"] == row["env_errors"] == 0.0
    dump = [json.loads(line) for line in open(tmp_path / "run" / "trajectories" / "step_1.jsonl")]
    assert len(dump) == 8 and any(trajectory["turns"] == 2 for trajectory in dump)
    prompts = {row["prompt"] for row in rows}
    for trajectory in dump:
        assert trajectory["messages"][0]["role"] == "user" and trajectory["messages"][0]["content"] in prompts
        roles = [m["role"] for m in trajectory["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant"][: 2 * trajectory["turns"]]
