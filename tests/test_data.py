import copy
import json
import logging
import os

import datasets
import pyarrow as pa
import pytest
import torch

from conftest import tokenize_prompt
from rl2.chat.template import tokenize_conversation
from rl2.data.rows import DataError, load_rows, parse_messages, split_rows, validate_rows
from rl2.data.conversations import PairDataset, RLDataset, SFTDataset
from rl2.testing.tiny import build_tiny_tokenizer

RL_ROWS = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "five"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital city?"}], "answer": "paris"},
    {"messages": [{"role": "user", "content": "sort the list"}], "answer": "sorted"},
]

CONVERSATION = [
    {"role": "system", "content": "You are a math tool user."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "<think>use the tool</think> <search>sum</search>"},
    {"role": "tool", "content": "result: 42"},
    {"role": "assistant", "content": "The answer is 42. \\boxed{42}"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def masked_runs(input_ids, loss_mask, tokenizer) -> list[str]:
    """Decoded text of each maximal run of loss_mask == 1."""
    runs, current = [], []
    for token, mask in zip(input_ids, loss_mask):
        if mask:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


# ----------------------------------------------------------------------------------------------
# load_rows: every format


def write_format(tmp_path, fmt: str) -> str:
    if fmt == "json_array":
        path = tmp_path / "rows.json"
        path.write_text(json.dumps(RL_ROWS, indent=2))
        return str(path)
    if fmt == "json_lines":
        return write_jsonl(tmp_path / "rows.json", RL_ROWS)
    if fmt == "jsonl":
        return write_jsonl(tmp_path / "rows.jsonl", RL_ROWS)
    if fmt == "csv":
        path = tmp_path / "rows.csv"
        rows = [{"messages": json.dumps(row["messages"]), "answer": row["answer"]} for row in RL_ROWS]
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
        return str(path)
    if fmt == "parquet":
        path = tmp_path / "rows.parquet"
        datasets.Dataset.from_list(RL_ROWS).to_parquet(str(path))
        return str(path)
    if fmt == "arrow_from_save_to_disk":
        datasets.Dataset.from_list(RL_ROWS).save_to_disk(str(tmp_path / "saved"))
        (arrow_file,) = [name for name in os.listdir(tmp_path / "saved") if name.endswith(".arrow")]
        return str(tmp_path / "saved" / arrow_file)
    if fmt == "arrow_ipc_file":
        path = tmp_path / "rows.arrow"
        table = pa.Table.from_pylist(RL_ROWS)
        with pa.ipc.new_file(str(path), table.schema) as writer:
            writer.write_table(table)
        return str(path)
    if fmt == "save_to_disk":
        datasets.Dataset.from_list(RL_ROWS).save_to_disk(str(tmp_path / "saved"))
        return str(tmp_path / "saved")
    if fmt == "dataset_dict":
        splits = {"train": datasets.Dataset.from_list(RL_ROWS[:1]), "test": datasets.Dataset.from_list(RL_ROWS)}
        datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
        return "test@" + str(tmp_path / "dict")
    raise AssertionError(fmt)


FORMATS = ["json_array", "json_lines", "jsonl", "csv", "parquet", "arrow_from_save_to_disk", "arrow_ipc_file", "save_to_disk", "dataset_dict"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_rows_every_format(tmp_path, fmt):
    rows = load_rows(write_format(tmp_path, fmt))
    assert len(rows) == len(RL_ROWS)
    assert sorted(rows.column_names) == ["answer", "messages"]
    for row, original in zip(rows, RL_ROWS):
        # Arrow fills keys missing from some messages with None; parse_messages drops them again
        # and decodes the JSON string cells of the CSV file.
        assert parse_messages(row["messages"], "here") == original["messages"]
        assert row["answer"] == original["answer"]
    validate_rows(rows, "rl", "rows")


def test_load_rows_default_split_of_dataset_dict(tmp_path):
    splits = {"train": datasets.Dataset.from_list(RL_ROWS[:1]), "test": datasets.Dataset.from_list(RL_ROWS)}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    rows = load_rows(str(tmp_path / "dict"))
    assert len(rows) == 1 and rows[0]["answer"] == "five"


def test_json_answers_keep_their_type(tmp_path):
    rows = [{"messages": RL_ROWS[0]["messages"], "answer": answer} for answer in ["3", "null", "[1, 2]"]]
    loaded = load_rows(write_jsonl(tmp_path / "a.jsonl", rows))
    assert list(loaded["answer"]) == ["3", "null", "[1, 2]"]
    lists = [{"messages": RL_ROWS[0]["messages"], "answer": [1, 2]}, {"messages": RL_ROWS[0]["messages"], "answer": [3]}]
    assert list(load_rows(write_jsonl(tmp_path / "b.jsonl", lists))["answer"]) == [[1, 2], [3]]


# ----------------------------------------------------------------------------------------------
# load_rows: errors


def test_file_not_found(tmp_path):
    with pytest.raises(DataError, match="file not found") as error:
        load_rows(str(tmp_path / "missing.jsonl"))
    assert "missing.jsonl" in str(error.value)
    with pytest.raises(DataError, match="file not found"):
        load_rows("no/such/dataset")  # not an "org/name" hub id
    with pytest.raises(DataError, match="file not found"):
        load_rows("test@" + str(tmp_path / "missing.parquet"))


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("blank.json", "\n  \n"), ("array.json", "[]"), ("header.csv", "messages,answer\n")])
def test_no_rows(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=f"no rows in .*{name}"):
        load_rows(str(tmp_path / name))


def test_no_rows_in_saved_dataset(tmp_path):
    datasets.Dataset.from_dict({"messages": [], "answer": []}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match="no rows in .*saved"):
        load_rows(str(tmp_path / "saved"))


def test_malformed_json_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RL_ROWS[0]) + "\n" + json.dumps(RL_ROWS[1]) + "\n" + '{"messages": [oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 3: malformed JSON"):
        load_rows(str(path))


def test_malformed_json_array(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n{"messages": [], "answer": 1},\n{"messages": [}\n]')
    with pytest.raises(DataError, match=r"bad\.json, line 3: malformed JSON"):
        load_rows(str(path))


def test_conflicting_types(tmp_path):
    rows = [RL_ROWS[0], RL_ROWS[1], {**RL_ROWS[2], "answer": 7}]
    with pytest.raises(DataError) as error:
        load_rows(write_jsonl(tmp_path / "mixed.jsonl", rows))
    message = str(error.value)
    assert "mixed.jsonl, row 3, field 'answer'" in message
    assert "a number here but a string before" in message


def test_conflicting_nested_types(tmp_path):
    rows = [RL_ROWS[0], {"messages": [{"role": "user", "content": 5}], "answer": "x"}]
    with pytest.raises(DataError) as error:
        load_rows(write_jsonl(tmp_path / "nested.jsonl", rows))
    assert "nested.jsonl, row 2, field 'messages': messages[].content is a number here but a string before" in str(error.value)


def test_unknown_split(tmp_path):
    splits = {"train": datasets.Dataset.from_list(RL_ROWS), "test": datasets.Dataset.from_list(RL_ROWS)}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"dict: unknown split 'valid'; available splits: \['test', 'train'\]"):
        load_rows("valid@" + str(tmp_path / "dict"))
    path = write_jsonl(tmp_path / "rows.jsonl", RL_ROWS)
    with pytest.raises(DataError, match=r"rows\.jsonl: unknown split 'test'"):
        load_rows("test@" + path)


# ----------------------------------------------------------------------------------------------
# validation


USER = {"role": "user", "content": "hello"}
ASSISTANT = {"role": "assistant", "content": "hi there"}

# (kind, bad row, field, words the message must contain); the bad row is written as row 3.
BAD_ROWS = [
    ("rl", {"messages": json.dumps({"role": "user", "content": "hi"}), "answer": "a"}, "messages",
     "list of {\"role\", \"content\"} messages, got dict"),
    ("rl", {"messages": '[{"role": "user", not json', "answer": "a"}, "messages", "not JSON"),
    ("rl", {"messages": "   ", "answer": "a"}, "messages", "the prompt text is empty"),
    ("rl", {"messages": json.dumps([{"role": "user", "content": 5}]), "answer": "a"}, "messages", "'content' should be a string, got int"),
    ("rl", {"messages": [], "answer": "a"}, "messages", "got an empty list"),
    ("rl", {"messages": [{"content": "x"}], "answer": "a"}, "messages", "messages[0] has no 'role'"),
    ("rl", {"messages": [USER, {"role": "bot", "content": "x"}], "answer": "a"}, "messages", "messages[1] has role 'bot'"),
    ("rl", {"messages": [{"role": "user", "content": None}], "answer": "a"}, "messages", "'content' should be a string, got null"),
    ("rl", {"messages": [USER], "answer": None}, "answer", "missing"),
    ("rl", {"messages": [USER]}, "answer", "missing"),
    ("sft", {"messages": [USER, {"role": "system", "content": "x"}]}, "messages", "at least one assistant message"),
    ("pair", {"messages": [USER], "chosen": "", "rejected": "no"}, "chosen", "non-empty string"),
    ("pair", {"messages": [USER], "chosen": "yes", "rejected": "   "}, "rejected", "non-empty string"),
    ("pair", {"messages": [USER, ASSISTANT], "chosen": "yes", "rejected": "no"}, "messages", "must not end with an assistant message"),
]

GOOD_ROWS = {
    "rl": {"messages": [USER], "answer": "a"},
    "sft": {"messages": [USER, ASSISTANT]},
    "pair": {"messages": [USER], "chosen": "yes", "rejected": "no"},
}


@pytest.mark.parametrize("kind, bad_row, field, words", BAD_ROWS)
def test_bad_rows(tmp_path, kind, bad_row, field, words):
    good = dict(GOOD_ROWS[kind])
    if isinstance(bad_row["messages"], str):  # keep the column one type, as a CSV file would
        good["messages"] = json.dumps(good["messages"])
    path = write_jsonl(tmp_path / "train.jsonl", [good, good, bad_row, good])
    with pytest.raises(DataError) as error:
        validate_rows(load_rows(path), kind, "train.jsonl")
    assert f"train.jsonl, row 3, field '{field}'" in str(error.value)
    assert words in str(error.value)


@pytest.mark.parametrize("kind, missing", [("sft", "messages"), ("pair", "rejected"), ("rl", "messages")])
def test_missing_column(tmp_path, kind, missing):
    rows = [{key: value for key, value in GOOD_ROWS[kind].items() if key != missing} | {"extra": 1}] * 2
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError) as error:
        validate_rows(load_rows(path), kind, path)
    assert f"train.jsonl: missing column '{missing}'" in str(error.value)
    assert "columns present: [" in str(error.value) and "'extra'" in str(error.value)


def test_rl_rows_without_an_answer_column(tmp_path, tokenizer):
    """An env that ignores answers (a reward model) takes prompt-only rows: answer None. Where the column
    exists, a row without a value is still an error."""
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [USER]}] * 3)
    dataset = RLDataset(path, tokenizer, max_length=64)
    assert len(dataset) == 3 and dataset[0]["answer"] is None and dataset[0]["messages"] == [USER]
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": [USER], "answer": "a"}, {"messages": [USER]}])
    with pytest.raises(DataError, match=r"mixed\.jsonl, row 2, field 'answer': missing \(null\); in a file with an"):
        RLDataset(mixed, tokenizer, max_length=64)


def test_datasets_validate_at_construction(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD_ROWS["rl"], GOOD_ROWS["rl"]])
    with pytest.raises(DataError, match=r"train\.jsonl, row 1, field 'messages': SFT rows need"):
        SFTDataset(path, tokenizer, max_length=64)
    with pytest.raises(DataError, match="missing column 'chosen'"):
        PairDataset(path, tokenizer, max_length=64)
    assert len(RLDataset(path, tokenizer, max_length=64)) == 2


# ----------------------------------------------------------------------------------------------
# tokenization


def test_tokenize_conversation_ids_and_mask(tokenizer):
    tokens = tokenize_conversation(CONVERSATION, tokenizer, max_length=None)
    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokens["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(tokens["loss_mask"]) == len(tokens["input_ids"])
    assert not tokens["truncated"]

    runs = masked_runs(tokens["input_ids"], tokens["loss_mask"], tokenizer)
    assert runs == [m["content"] + "<|im_end|>" for m in CONVERSATION if m["role"] == "assistant"]

    unmasked = tokenizer.decode([t for t, m in zip(tokens["input_ids"], tokens["loss_mask"]) if not m])
    for message in CONVERSATION:
        assert (message["content"] in unmasked) == (message["role"] != "assistant")
    assert unmasked.count("<|im_start|>assistant\n") == 2
    assert unmasked.endswith("<|im_start|>assistant\n\n")  # the "\n" after each assistant <|im_end|>


def test_tokenize_conversation_with_saved_tokenizer(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(str(tmp_path / "tok"))
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert tokenize_conversation(CONVERSATION, loaded, None) == tokenize_conversation(CONVERSATION, tokenizer, None)


def test_tokenize_conversation_truncation(tokenizer):
    full = tokenize_conversation(CONVERSATION, tokenizer, max_length=None)
    n = len(full["input_ids"])
    cut = tokenize_conversation(CONVERSATION, tokenizer, max_length=20)
    assert cut == {"input_ids": full["input_ids"][:20], "loss_mask": full["loss_mask"][:20], "truncated": True}
    assert tokenize_conversation(CONVERSATION, tokenizer, max_length=n) == full
    assert tokenize_conversation(CONVERSATION, tokenizer, max_length=n - 1)["truncated"]


def test_rl_prompt_ids_are_the_templated_prompt(tokenizer):
    ids = RLDataset(datasets.Dataset.from_list([{"messages": CONVERSATION[:2], "answer": 42}]), tokenizer, None)[0]["prompt_ids"]
    assert ids == tokenize_prompt(CONVERSATION[:2], tokenizer)  # the tests' helper (conftest) agrees
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a math tool user.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_non_prefix_consistent_template(tokenizer):
    # Drops the reasoning of earlier assistant turns, as Qwen3-style templates do.
    stripping = copy.deepcopy(tokenizer)
    stripping.chat_template = (
        "{%- for message in messages %}"
        "{%- set content = message['content'] %}"
        "{%- if message['role'] == 'assistant' and not loop.last %}{%- set content = content.split('</think>')[-1] %}{%- endif %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(DataError, match="not prefix-consistent"):
        tokenize_conversation(CONVERSATION, stripping, max_length=None)
    # A single assistant turn is still fine.
    tokens = tokenize_conversation(CONVERSATION[:3], stripping, max_length=None)
    assert masked_runs(tokens["input_ids"], tokens["loss_mask"], tokenizer) == [CONVERSATION[2]["content"] + "<|im_end|>"]


# ----------------------------------------------------------------------------------------------
# datasets


def test_sft_dataset_from_csv(tmp_path, tokenizer):
    rows = [{"messages": json.dumps(CONVERSATION)}, {"messages": json.dumps([USER, ASSISTANT])}]
    path = str(tmp_path / "sft.csv")
    datasets.Dataset.from_list(rows).to_csv(path, index=False)
    dataset = SFTDataset(path, tokenizer, max_length=30)
    assert len(dataset) == 2
    short = dataset[1]
    expected = tokenize_conversation([USER, ASSISTANT], tokenizer, None)
    assert short["input_ids"].dtype == torch.long and short["loss_mask"].dtype == torch.long
    assert short["input_ids"].tolist() == expected["input_ids"]
    assert short["loss_mask"].tolist() == expected["loss_mask"]
    assert dataset.num_truncated == 0
    long = dataset[0]
    assert len(long["input_ids"]) == 30
    assert dataset.num_truncated == 1


def test_rl_dataset_skips_long_prompts(tmp_path, tokenizer, caplog):
    rows = [{"messages": [{"role": "user", "content": "word " * n}], "answer": n} for n in [1, 30, 2, 40, 3]]
    max_length = len(tokenize_prompt(rows[4]["messages"], tokenizer))
    assert len(tokenize_prompt(rows[1]["messages"], tokenizer)) > max_length
    path = write_jsonl(tmp_path / "rl.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="rl2.data"):
        dataset = RLDataset(path, tokenizer, max_length=max_length)
    assert dataset.num_skipped == 2
    assert len(dataset) == 3
    assert [dataset[i]["answer"] for i in range(3)] == [1, 2, 3]
    for i, row in enumerate([rows[0], rows[2], rows[4]]):
        assert dataset[i]["prompt_ids"] == tokenize_prompt(row["messages"], tokenizer)
        assert dataset[i]["messages"] == row["messages"]
    assert "dropped 2 of 5 prompts" in caplog.text and "first: row 2" in caplog.text

    assert RLDataset(path, tokenizer, max_length=None).num_skipped == 0
    with pytest.raises(DataError, match="every prompt is longer"):
        RLDataset(path, tokenizer, max_length=3)


def test_pair_dataset_masks_only_the_response(tokenizer):
    prompt = CONVERSATION[:4]  # ends with a tool message; includes an earlier assistant turn
    rows = datasets.Dataset.from_list([{"messages": prompt, "chosen": "It is 42.", "rejected": "It is 41, maybe."}])
    dataset = PairDataset(rows, tokenizer, max_length=None, source="pairs")
    item = dataset[0]
    for field, response in [("chosen", "It is 42."), ("rejected", "It is 41, maybe.")]:
        ids, mask = item[field]["input_ids"].tolist(), item[field]["loss_mask"].tolist()
        text = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": response}], tokenize=False)
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert masked_runs(ids, mask, tokenizer) == [response + "<|im_end|>"]
    assert dataset.num_truncated == 0

    short = PairDataset(rows, tokenizer, max_length=10, source="pairs")
    item = short[0]
    assert len(item["chosen"]["input_ids"]) == 10 and len(item["rejected"]["input_ids"]) == 10
    assert short.num_truncated == 1  # one item, though both of its sequences were cut


def test_split_rows():
    rows = datasets.Dataset.from_dict({"x": list(range(20))})
    train, test = split_rows(rows, test_ratio=0.1, seed=0)
    assert (len(train), len(test)) == (18, 2)
    assert sorted(list(train["x"]) + list(test["x"])) == list(range(20))
    assert list(train["x"]) == sorted(train["x"])
    again_train, again_test = split_rows(rows, test_ratio=0.1, seed=0)
    assert (list(again_train["x"]), list(again_test["x"])) == (list(train["x"]), list(test["x"]))
    other_tests = {tuple(split_rows(rows, test_ratio=0.1, seed=seed)[1]["x"]) for seed in range(1, 6)}
    assert other_tests != {tuple(test["x"])}

    assert len(split_rows(rows, test_ratio=0.001, seed=0)[1]) == 1
    train, test = split_rows(rows, test_ratio=0.0, seed=0)
    assert (len(train), len(test)) == (20, 0)
    with pytest.raises(DataError, match="no training rows"):
        split_rows(datasets.Dataset.from_dict({"x": [1]}), test_ratio=0.5, seed=0)
