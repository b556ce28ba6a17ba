"""Rows as RL2, TRL and verl feed them (issue 64, items 4 and 10): a string prompt column is one user message
through the chat template; RL rows for an env file written to RL2 HEAD's interface need no prompt at all (the
file's `generate` reads the row and makes the prompt); truly malformed rows still fail with file, row and field."""

import json
import textwrap

import datasets
import pytest

from conftest import run_python, tokenize_prompt
from rl2.config import load_config
from rl2.data.conversations import PairDataset, RLDataset, SFTDataset
from rl2.data.rows import Columns, DataError, load_rows, validate_rows
from rl2.metrics import read_metrics
from rl2.testing.tiny import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_question_column_named_by_messages_key_is_one_user_message(tmp_path, tokenizer):
    """`data.messages_key=question` on a plain question/answer file (it failed with "got a string")."""
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "What is 2 + 3?", "answer": "5"},
                                               {"question": "42", "answer": "42"}])  # JSON-parsable text stays text
    dataset = RLDataset(path, tokenizer, None, columns=Columns(messages_key="question"))
    assert dataset[0]["messages"] == user("What is 2 + 3?") and dataset[1]["messages"] == user("42")
    assert dataset[0]["prompt_ids"] == tokenize_prompt(user("What is 2 + 3?"), tokenizer)  # through the template


def test_a_prompt_column_is_read_when_there_is_no_messages_column(tmp_path, tokenizer):
    """deep_research's and Countdown's rows (`prompt` and other columns) with RL2's default apply_chat_template."""
    rows = [{"prompt": "Using [3, 5], make 8.", "numbers": [3, 5], "target": 8}]
    dataset = RLDataset(write_jsonl(tmp_path / "countdown.jsonl", rows), tokenizer, None)
    item = dataset[0]
    assert item["messages"] == user("Using [3, 5], make 8.") and item["answer"] is None
    assert item["prompt_ids"] == tokenize_prompt(user("Using [3, 5], make 8."), tokenizer)
    assert item["row"] == rows[0]  # every column, as RL2 HEAD's env files read it
    question = RLDataset(write_jsonl(tmp_path / "q.jsonl", [{"question": "Why?", "answer": 1}]), tokenizer, None,
                         columns=Columns(prompt_key="question"))
    assert question[0]["messages"] == user("Why?")


def test_each_row_reads_its_messages_else_its_prompt(tmp_path, tokenizer):
    rows = [{"messages": user("from messages"), "prompt": "ignored", "answer": 1},
            {"messages": None, "prompt": "from prompt", "answer": 2}]
    dataset = RLDataset(write_jsonl(tmp_path / "mixed.jsonl", rows), tokenizer, None)
    assert [dataset[i]["messages"] for i in range(2)] == [user("from messages"), user("from prompt")]


def test_raw_prompts_stay_raw(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "raw.jsonl", [{"prompt": "Q: 2 + 3?\nA:", "answer": 5}])
    item = RLDataset(path, tokenizer, None, columns=Columns(apply_chat_template=False))[0]
    assert item["prompt_ids"] == tokenizer("Q: 2 + 3?\nA:", add_special_tokens=False)["input_ids"]


def test_string_prompts_for_preference_pairs_and_sft(tmp_path, tokenizer):
    """TRL's preference rows (`prompt`, `chosen`, `rejected` as text) train as pairs; an SFT row of one
    string has no assistant turn: an error naming the row and field."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Capital of France?", "chosen": "Paris.",
                                                    "rejected": "Lyon."}])
    item = PairDataset(pairs, tokenizer, None)[0]
    chosen = tokenizer.decode(item["chosen"]["input_ids"])
    assert "Capital of France?" in chosen and "Paris." in chosen
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"messages": "just a question"}])
    with pytest.raises(DataError, match=r"sft\.jsonl, row 1, field 'messages': SFT rows need at least one assistant"):
        SFTDataset(sft, tokenizer, None)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": 6, "answer": 1}, {"prompt": 7, "answer": 1}],
     "bad.jsonl, row 1, field 'prompt': expected a non-empty list of {\"role\", \"content\"} messages, got int"),
    ([{"prompt": "fine", "answer": 1}, {"prompt": "", "answer": 1}],
     "bad.jsonl, row 2, field 'prompt': the prompt text is empty"),
    ([{"messages": '[{"role": "user", "content": "x"}]', "answer": 1}, {"messages": '[{"role": "user",', "answer": 1}],
     "bad.jsonl, row 2, field 'messages': expected a non-empty list of {\"role\", \"content\"} messages, got a string "
     "that is not JSON"),
    ([{"messages": user("a"), "prompt": None, "answer": 1}, {"messages": None, "prompt": None, "answer": 1}],
     "bad.jsonl, row 2 has no 'messages' column (data.messages_key) or 'prompt' text (data.prompt_key)"),
    ([{"question": "a", "answer": 1}],
     "bad.jsonl: missing column 'messages' (data.messages_key) needed for rl data; columns present: ['question', "
     "'answer']; a column of prompt text is also read, as one user message: data.prompt_key=<its name> (now 'prompt')"),
], ids=["number", "empty", "broken-json", "neither", "no-column"])
def test_malformed_rows_name_file_row_and_field(tmp_path, tokenizer, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as error:
        validate_rows(load_rows(path), "rl", "bad.jsonl")
    assert message in str(error.value)


def test_rows_without_a_prompt_when_the_env_file_makes_it(tokenizer):
    """RL2's gem example trains on rows with no prompt (Chenmien/EmptyDataset): its env file's generate makes it."""
    rows = datasets.Dataset.from_list([{"env_idx": i} for i in range(3)])
    with pytest.raises(DataError, match="missing column 'messages'"):
        RLDataset(rows, tokenizer, None)
    dataset = RLDataset(rows, tokenizer, 16, columns=Columns(prompt_optional=True))
    assert len(dataset) == 3 and dataset.num_skipped == 0
    assert dataset[1] == {"prompt_ids": [], "messages": [], "answer": None, "tools": None, "source": None,
                          "row": {"env_idx": 1}}
    raw = RLDataset(rows, tokenizer, None, columns=Columns(apply_chat_template=False, prompt_optional=True))
    assert raw[0]["messages"] == [] and raw[0]["prompt_ids"] == []
    with pytest.raises(DataError, match="missing column 'messages'"):  # only RL rows may have no prompt
        SFTDataset(rows, tokenizer, None, columns=Columns(prompt_optional=True))


RL2_HEAD_FILE = '''
from RL2.datasets import Sample, initialize_state_dict, add_llm_response, add_env_response
from RL2.utils.communication import async_request


async def generate(config, tokenizer, router_url, sample):
    """A gem-style file: the prompt comes from the file (here from the row's `level`), not from the data."""
    sample.state_text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Say something at level {sample.sample['level']}."}],
        add_generation_prompt=True, tokenize=False)
    sample.state_dict = initialize_state_dict(tokenizer, sample.state_text)
    response = await async_request(router_url, "generate", json={
        "input_ids": sample.state_dict["states"], "sampling_params": dict(config.sampling_params),
        "return_logprob": True})
    add_llm_response(sample, response)
    add_env_response(tokenizer, sample, {"next_state": None, "done": True, "reward": float(sample.sample["level"])})
'''

PLAIN_FILE = "def reward_fn(messages, answer):\n    return 0.0\n"


def test_columns_for_a_run_follow_the_env_file(tmp_path):
    head, plain = tmp_path / "head.py", tmp_path / "plain.py"
    head.write_text(RL2_HEAD_FILE)
    plain.write_text(PLAIN_FILE)
    assert Columns.for_run(load_config([f"rollout.env_path={head}"]), "rl").prompt_optional is True
    assert Columns.for_run(load_config([f"rollout.env_path={head}"]), "sft").prompt_optional is False
    assert Columns.for_run(load_config([f"rollout.env_path={plain}"]), "rl").prompt_optional is False
    columns = Columns.for_run(load_config(["data.messages_key=question", "data.apply_chat_template=false"]), "rl")
    assert columns == Columns("question", False, "prompt", False)


def test_ppo_trains_on_rows_without_a_prompt_with_an_rl2_head_env_file(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "empty.jsonl", [{"level": i % 2} for i in range(4)])
    env = tmp_path / "gem_style.py"
    env.write_text(textwrap.dedent(RL2_HEAD_FILE))
    run_python(["-m", "rl2.trainer.ppo", f"data.path={data}", "data.prompts_per_rollout=2", "data.test_ratio=0",
                "data.responses_per_prompt=2", f"actor.model_name={tiny_model_dir}", "actor.dtype=float32",
                "actor.gradient_checkpointing=false", f"actor.save_dir={tmp_path / 'run'}", f"rollout.env_path={env}",
                "rollout.dynamic_filtering=false", "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 4}",
                "trainer.total_steps=1", "trainer.disable_wandb=true", "data.shuffle=false"])
    [metrics] = read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
    assert metrics["env_errors"] == 0 and metrics["reward_errors"] == 0 and "actor/loss" in metrics
    assert metrics["reward/mean"] == pytest.approx(0.5)  # levels 0 and 1, the file's own rewards


def test_an_evaluation_on_rows_without_a_prompt_with_an_rl2_head_env_file(tiny_model_dir, tmp_path):
    """RL2's deepresearch_eval.sh shape (trainer.eval_only=true, the test set read by the file's generate)."""
    data = write_jsonl(tmp_path / "empty.jsonl", [{"level": 1}] * 2)
    env = tmp_path / "gem_style.py"
    env.write_text(textwrap.dedent(RL2_HEAD_FILE))
    run_python(["-m", "rl2.trainer.ppo", f"data.test_path={data}", "trainer.eval_only=true",
                f"actor.model_name={tiny_model_dir}", "actor.dtype=float32", f"actor.save_dir={tmp_path / 'run'}",
                f"rollout.env_path={env}", "rollout.test_sampling_params={temperature: 0.0, max_new_tokens: 4}",
                "trainer.disable_wandb=true"])
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["prompts"] == 2 and report["test/reward_mean"] == pytest.approx(1.0)  # the file's reward, level 1
