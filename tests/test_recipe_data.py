"""The recipes' data preparation scripts (recipes/*/prepare_data.py): each on its shipped samples,
run from an unrelated folder; the rows are valid RL data whose answers the env files grade 1.0;
parquet input; malformed rows; and the math recipe's answer extraction."""

import importlib.util
import json
import os
import subprocess
import sys

import datasets
import pytest

from rl2.data.conversations import RLDataset
from rl2.data.rows import load_rows, validate_rows
from rl2.rollout.env import Env
from rl2.testing.tiny import build_tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = {
    "rstar2_agent": ["dapo_math_17k.jsonl", "aime_test.jsonl"],
    "search_r1": ["nq_train.jsonl", "hotpotqa_dev.jsonl"],
    "math_grpo": ["gsm8k_train.jsonl", "math_test.jsonl"],
}
INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def script_path(name: str) -> str:
    return os.path.join(REPO, "recipes", name, "prepare_data.py")


def sample_path(name: str, file: str) -> str:
    return os.path.join(REPO, "recipes", name, "sample", file)


def load_module(path: str, module_name: str):
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def run_script(name: str, args: list[str], cwd) -> subprocess.Popen:
    # No PYTHONPATH: the script has to find this checkout's rl2 by itself.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return subprocess.Popen(
        [sys.executable, script_path(name), *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


@pytest.fixture(scope="module")
def scripts() -> dict:
    """The three scripts as modules, to call their functions directly."""
    return {name: load_module(script_path(name), f"prepare_{name}_under_test") for name in SAMPLES}


@pytest.fixture(autouse=True)
def restore_datasets_logging():
    """`main` silences datasets' progress bars and logs; give other tests theirs back."""
    verbosity, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    yield
    datasets.logging.set_verbosity(verbosity)
    if bars:
        datasets.enable_progress_bars()


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict:
    """Each script on its shipped samples, in subprocesses (all three at once) whose working folder
    holds nothing of the repository; name -> (summary line, output rows, output path)."""
    cwd = tmp_path_factory.mktemp("cwd")
    processes = {}
    for name, files in SAMPLES.items():
        args = [arg for file in files for arg in ("--input", sample_path(name, file))]
        processes[name] = run_script(name, [*args, "--output", f"out/{name}/train.jsonl"], cwd)
    results = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, stderr
        path = cwd / "out" / name / "train.jsonl"
        results[name] = (stdout.strip(), read_jsonl(path), str(path))
    return results


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


# ----------------------------------------------------------------------------------------------
# shipped samples


@pytest.mark.parametrize("name", list(SAMPLES))
def test_sample_output_is_valid_rl_data(name, outputs, tokenizer):
    summary, rows, path = outputs[name]
    assert len(summary.splitlines()) == 1
    validate_rows(load_rows(path), "rl", path)
    dataset = RLDataset(path, tokenizer, max_length=None)
    assert len(dataset) == len(rows)
    assert dataset[0]["prompt_ids"] and dataset[0]["messages"] == rows[0]["messages"]


def test_rstar2_agent_samples(outputs):
    summary, rows, _ = outputs["rstar2_agent"]
    dapo, aime = (sample_path("rstar2_agent", file) for file in SAMPLES["rstar2_agent"])
    assert summary.startswith("read 20 rows, wrote 16 to out/rstar2_agent/train.jsonl, dropped 4 duplicate problems")
    assert f"{dapo}: 16 read, 12 written" in summary and f"{aime}: 4 read, 4 written" in summary
    assert len(rows) == 16
    assert len({row["messages"][1]["content"] for row in rows}) == 16

    system_prompt = load_module(os.path.join(REPO, "envs", "python_tool.py"), "python_tool_for_test").SYSTEM_PROMPT
    for row in rows:
        assert [m["role"] for m in row["messages"]] == ["system", "user"]
        assert row["messages"][0]["content"] == system_prompt
        assert isinstance(row["answer"], str)
        assert "Solve the following" not in row["messages"][1]["content"]
        assert "Answer:" not in row["messages"][1]["content"]
    assert rows[0]["messages"][1]["content"] == "What is the sum of the first 10 positive integers?"
    assert rows[0]["answer"] == "55"
    assert rows[-1]["messages"][1]["content"] == "Find the sum of all positive divisors of 28."
    assert rows[-1]["answer"] == "56"  # an integer in the input


def test_search_r1_samples(outputs, scripts):
    summary, rows, _ = outputs["search_r1"]
    assert summary.startswith("read 14 rows, wrote 14 to out/search_r1/train.jsonl")
    assert len(rows) == 14
    make_prompt = scripts["search_r1"].make_prompt
    assert rows[0] == {
        "messages": [{"role": "user", "content": make_prompt("what is the capital of Australia?")}],
        "answer": ["Canberra"],
    }
    assert rows[3]["messages"][0]["content"].endswith("Question: Who wrote Pride and Prejudice?\n")  # no "??"
    assert rows[10]["answer"] == ["Kenyan shilling"]  # HotpotQA: one answer string
    assert all(row["messages"][0]["content"].endswith("?\n") for row in rows)


def test_math_grpo_samples(outputs):
    summary, rows, _ = outputs["math_grpo"]
    assert summary.startswith("read 14 rows, wrote 14 to out/math_grpo/train.jsonl")
    assert len(rows) == 14
    assert rows[0] == {
        "messages": [{"role": "user", "content": "Tom has 3 boxes with 12 pencils in each box. "
                      "How many pencils does Tom have?" + INSTRUCTION}],
        "answer": "36",
    }
    assert rows[1]["answer"] == "1500"  # "#### 1,500"
    assert rows[8]["answer"] == "10000"
    assert [row["answer"] for row in rows[10:]] == ["13", "\\frac{1}{3}", "\\frac{\\sqrt{3}}{2}", "\\{-1, 0, 1\\}"]
    assert all(row["messages"][0]["content"].endswith(INSTRUCTION) for row in rows)


def test_math_answers_are_gradeable(outputs):
    rows = outputs["math_grpo"][1] + outputs["rstar2_agent"][1]
    replies = [{"role": "assistant", "content": f"\\boxed{{{row['answer']}}}"} for row in rows]
    conversations = [row["messages"] + [reply] for row, reply in zip(rows, replies)]
    with Env(os.path.join(REPO, "envs", "math_reward.py"), timeout=30.0) as env:
        results = env.rewards(conversations, [row["answer"] for row in rows])
    assert [(r.value, r.error) for r in results] == [(1.0, None)] * len(rows)


def test_search_answers_are_gradeable_and_in_the_corpus(outputs):
    search = load_module(os.path.join(REPO, "envs", "search.py"), "search_env_for_test")
    with open(os.path.join(REPO, "recipes", "data", "search_corpus.jsonl"), encoding="utf-8") as f:
        corpus = " ".join(json.loads(line)["contents"] for line in f).lower()
    # the samples' questions and answers are those of recipes/data/search_qa.jsonl, made for this corpus
    qa = {row["messages"][0]["content"].lower(): row["answer"]
          for row in read_jsonl(os.path.join(REPO, "recipes", "data", "search_qa.jsonl"))}
    for row in outputs["search_r1"][1]:
        assert qa[row["messages"][0]["content"].lower()][0] == row["answer"][0]
        for gold in row["answer"]:
            reply = {"role": "assistant", "content": f"<answer>{gold}</answer>"}
            assert search.reward_fn(row["messages"] + [reply], row["answer"]) == 1.0
        assert row["answer"][0].lower() in corpus


# ----------------------------------------------------------------------------------------------
# options and input formats


def test_dapo_parquet_with_nested_columns(tmp_path, monkeypatch, capsys, scripts):
    rows = read_jsonl(sample_path("rstar2_agent", "dapo_math_17k.jsonl"))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "dapo.parquet"))
    monkeypatch.chdir(tmp_path)
    assert scripts["rstar2_agent"].main(["--input", "dapo.parquet", "--output", "out.jsonl"]) == 0
    assert "read 16 rows, wrote 12 to out.jsonl, dropped 4 duplicate problems" in capsys.readouterr().out
    expected = [scripts["rstar2_agent"].convert_row(row) for row in rows]
    assert read_jsonl(tmp_path / "out.jsonl") == [row for i, row in enumerate(expected) if row not in expected[:i]]


def test_no_dedup_and_limit(tmp_path, monkeypatch, capsys, scripts):
    monkeypatch.chdir(tmp_path)
    main = scripts["rstar2_agent"].main
    dapo, aime = (sample_path("rstar2_agent", file) for file in SAMPLES["rstar2_agent"])
    assert main(["--input", dapo, "--input", aime, "--output", "all.jsonl", "--no-dedup"]) == 0
    assert len(read_jsonl("all.jsonl")) == 20
    assert main(["--input", dapo, "--input", aime, "--output", "five.jsonl", "--limit", "5"]) == 0
    assert len(read_jsonl("five.jsonl")) == 5
    assert "read 6 rows, wrote 5" in capsys.readouterr().out.splitlines()[-1]  # one duplicate among the first 6


def test_plain_problem_rows(scripts):
    convert_row = scripts["rstar2_agent"].convert_row
    assert convert_row({"Problem": " What is 2 + 2? ", "Answer": 4.0})["answer"] == "4"
    assert convert_row({"question": "What is 1 + 2?", "answer": "3"})["messages"][1]["content"] == "What is 1 + 2?"
    # a DAPO-style row whose prompt lacks the wrapper is taken as it is
    row = {"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "reward_model": {"ground_truth": "7"}}
    assert convert_row(row)["messages"][1]["content"] == "What is 3 + 4?"


def test_math_500_rows_use_the_answer_field(scripts):
    row = {"problem": "Compute $1/2 + 1/4$.", "solution": "... \\boxed{\\frac34}", "answer": "\\frac{3}{4}"}
    assert scripts["math_grpo"].convert_row(row)["answer"] == "\\frac{3}{4}"


def test_search_gold_answer_forms(scripts):
    convert_row = scripts["search_r1"].convert_row
    assert convert_row({"question": "who is it", "answer": ["A", " B "]})["answer"] == ["A", "B"]  # NQ-open
    assert convert_row({"question": "who is it?", "answer": "C"})["answer"] == ["C"]  # HotpotQA
    assert convert_row({"question": "who", "golden_answers": ["D"], "answer": None})["answer"] == ["D"]


# ----------------------------------------------------------------------------------------------
# malformed rows

GOOD = {
    "rstar2_agent": {"problem": "What is 1 + 1?", "answer": "2"},
    "search_r1": {"id": "train_0", "question": "who wrote hamlet", "golden_answers": ["Shakespeare"]},
    "math_grpo": {"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"},
}
MALFORMED = [
    ("rstar2_agent", {"answer": "3"}, "no 'prompt', 'problem' or 'question' field"),
    ("rstar2_agent", {"problem": "What is 1 + 2?", "answer": None}, "no 'answer'"),
    ("search_r1", {"id": "train_1", "golden_answers": ["x"]}, "no 'question' field"),
    ("search_r1", {"id": "train_1", "question": "who", "golden_answers": []},
     "'golden_answers' has no non-empty answer"),
    ("math_grpo", {"question": "What is 1 + 2?", "answer": "1 + 2 = 3\nThe answer is 3"},
     "no '####' final answer in 'answer'"),
    ("math_grpo", {"problem": "What is 1 + 2?", "solution": "It is $3$."}, "no \\boxed{...} answer in 'solution'"),
]


@pytest.mark.parametrize("name,bad,message", MALFORMED)
def test_malformed_row_fails_and_writes_nothing(name, bad, message, tmp_path, monkeypatch, capsys, scripts):
    monkeypatch.chdir(tmp_path)
    os.makedirs("data")
    with open("data/bad.jsonl", "w") as f:
        f.write(json.dumps(GOOD[name]) + "\n" + json.dumps(bad) + "\n")
    assert scripts[name].main(["--input", "data/bad.jsonl", "--output", "out/train.jsonl"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: data/bad.jsonl row 2: {message}\n"
    assert captured.out == ""
    assert os.listdir("out") == []  # neither the output nor a temporary file


def test_malformed_row_in_a_subprocess(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps(GOOD["math_grpo"]) + "\n" + json.dumps({"question": "q"}) + "\n")
    (tmp_path / "train.jsonl").write_text("an earlier output\n")
    process = run_script("math_grpo", ["--input", "gsm8k.jsonl", "--output", "train.jsonl"], tmp_path)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 2
    assert stderr == "error: gsm8k.jsonl row 2: no 'answer' field\n"  # one line, no traceback
    assert (tmp_path / "train.jsonl").read_text() == "an earlier output\n"  # left as it was
    assert sorted(os.listdir(tmp_path)) == ["gsm8k.jsonl", "train.jsonl"]


def test_unreadable_input_fails(tmp_path, monkeypatch, capsys, scripts):
    monkeypatch.chdir(tmp_path)
    assert scripts["search_r1"].main(["--input", "missing.jsonl", "--output", "out.jsonl"]) == 2
    assert capsys.readouterr().err == "error: missing.jsonl: file not found\n"
    assert not os.path.exists("out.jsonl")


# ----------------------------------------------------------------------------------------------
# answer extraction (math_grpo)


@pytest.mark.parametrize("text,expected", [
    ("so $x = \\boxed{5}$.", "5"),
    ("first \\boxed{1}, then \\boxed{2}", "2"),  # the last box wins
    ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("$\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\frac{\\sqrt{3}}{2}"),
    ("$\\boxed{(3, \\{1,2\\})}$", "(3, \\{1,2\\})"),  # escaped braces do not count
    ("$\\boxed{\\}}$", "\\}"),
    ("\\fbox{7}", "7"),
    ("\\boxed{1} or \\fbox{2}", "2"),
    ("\\fbox{2} or \\boxed{1}", "1"),
    ("$\\boxed 5$.", "5"),
    ("\\boxed { 12 } ", "12"),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}"),
])
def test_last_boxed(text, expected, scripts):
    assert scripts["math_grpo"].last_boxed(text) == expected


@pytest.mark.parametrize("text,error", [
    ("the answer is 5", "no \\\\boxed"),
    ("\\boxed{\\frac{1}{2}", "unbalanced"),
    ("\\boxed{1} and then \\boxed{2", "unbalanced"),  # no falling back to an earlier box
    ("\\boxed{3\\}", "unbalanced"),
    ("\\boxed{}", "empty"),
    ("\\boxed", "no braces"),
])
def test_last_boxed_errors(text, error, scripts):
    with pytest.raises(ValueError, match=error):
        scripts["math_grpo"].last_boxed(text)


@pytest.mark.parametrize("solution,expected", [
    ("3 + 4 = <<3+4=7>>7\n#### 7", "7"),
    ("#### 1,234,567", "1234567"),
    ("a #### b\n#### -2.5 ", "-2.5"),  # the last marker
])
def test_gsm8k_answer(solution, expected, scripts):
    assert scripts["math_grpo"].gsm8k_answer(solution) == expected


def test_original_hotpotqa_json_is_read(tmp_path):
    """HotpotQA's own JSON files mix strings and numbers in `supporting_facts` and `context`, which
    arrow cannot type: the scripts read such a file with the json module instead."""
    rows = [
        {"_id": "5a8b", "question": "Which country's currency is the Kenyan shilling", "answer": "Kenya",
         "supporting_facts": [["Kenya", 0], ["Kenyan shilling", 1]],
         "context": [["Kenya", ["Kenya is a country.", 3]]], "type": "bridge", "level": "easy"},
        {"_id": "5a8c", "question": "Where is Paris?", "answer": "France",
         "supporting_facts": [], "context": [], "type": "comparison", "level": "hard"},
    ]
    path = tmp_path / "hotpot_dev_distractor_v1.json"
    path.write_text(json.dumps(rows))
    result = run_script("search_r1", ["--input", str(path), "--output", "out.jsonl"], tmp_path)
    stdout, stderr = result.communicate(timeout=120)
    assert result.returncode == 0, stderr
    written = read_jsonl(tmp_path / "out.jsonl")
    assert [row["answer"] for row in written] == [["Kenya"], ["France"]]
    assert written[0]["messages"][0]["content"].endswith("Question: Which country's currency is the Kenyan shilling?\n")
    (tmp_path / "broken.json").write_text('[{"question": "a?", "answer": "b"}, ')
    result = run_script("search_r1", ["--input", str(tmp_path / "broken.json"), "--output", "out2.jsonl"], tmp_path)
    _, stderr = result.communicate(timeout=120)
    assert result.returncode == 2 and "broken.json" in stderr and not (tmp_path / "out2.jsonl").exists()
