"""reasoning-gym as a source of RL tasks: rows (`python -m rl2.data.reasoning_gym`), the env file
(`envs/reasoning_gym.py`: each task's own scorer), per-source test metrics (`test/<data_source>/reward_mean`)
and the recipe's GRPO run on 2 ranks. Skipped without reasoning-gym (`pip install 'rl2[envs]'`)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from conftest import REPO, run_torchrun  # noqa: E402
from rl2.config import load_config  # noqa: E402
from rl2.config_checks import check_config  # noqa: E402
from rl2.data import reasoning_gym as rg_rows  # noqa: E402
from rl2.data.conversations import RLDataset  # noqa: E402
from rl2.data.rows import load_rows, validate_rows  # noqa: E402
from rl2.engines import SamplingParams  # noqa: E402
from rl2.metrics import read_metrics  # noqa: E402
from rl2.rollout.env import Env, EnvArgs, EnvError  # noqa: E402
from rl2.rollout.env_file import load_env_file  # noqa: E402
from rl2.rollout.multi_turn import assign_rewards, rollout  # noqa: E402
from rl2.rollout.rollout_metrics import eval_metrics  # noqa: E402
from rl2.rollout.trajectory import Trajectory  # noqa: E402
from scripted_engine import ScriptedEngine  # noqa: E402

ENV_PATH = os.path.join(REPO, "envs", "reasoning_gym.py")
TASKS = ["basic_arithmetic", "chain_sum", "gcd", "leg_counting", "spell_backward"]
# Tasks whose entries follow the hash seed (sets of strings): the command's rows must not.
HASH_SEEDED = "isomorphic_strings,ransom_note"


def cli(*args: str, hash_seed: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONHASHSEED": hash_seed}
    return subprocess.Popen([sys.executable, "-m", "rl2.data.reasoning_gym", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.fixture(scope="module")
def row_files(tmp_path_factory) -> dict[str, str]:
    """The command run twice at once under other hash seeds, on the 5 tasks and 2 hash-seeded ones:
    {"train", "test", "train_again", "test_again"} files."""
    folder = tmp_path_factory.mktemp("rows")
    files = {name: str(folder / f"{name}.jsonl") for name in ("train", "test", "train_again", "test_again")}
    tasks = ",".join(TASKS) + "," + HASH_SEEDED
    runs = [cli(tasks, "--rows", "21", "--seed", "7", "--out", files[f"train{suffix}"], "--test-rows", "14",
                "--test-out", files[f"test{suffix}"], hash_seed=hash_seed)
            for suffix, hash_seed in (("", "1"), ("_again", "2"))]
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        assert out.startswith("wrote 21 training rows to") and "and 14 test rows to" in out
    return files


def reply(text: str) -> list[dict]:
    return [{"role": "user", "content": "question"}, {"role": "assistant", "content": text}]


def test_rows_are_the_same_for_the_same_arguments_and_mixed(row_files):
    train, test = read_jsonl(row_files["train"]), read_jsonl(row_files["test"])
    # Byte for byte, though the runs had other hash seeds and two tasks draw from sets of strings.
    assert open(row_files["train"]).read() == open(row_files["train_again"]).read()
    assert open(row_files["test"]).read() == open(row_files["test_again"]).read()
    tasks = TASKS + HASH_SEEDED.split(",")
    assert [row["data_source"] for row in train] == tasks * 3  # interleaved: each task in turn
    assert [row["data_source"] for row in test] == tasks * 2
    for row in train + test:
        assert set(row) == {"messages", "answer", "data_source"}
        (message,) = row["messages"]
        task, entry = rg_rows.read_answer(row["answer"])
        assert task == row["answer"]["task"] == row["data_source"] and isinstance(row["answer"]["entry"], str)
        assert message["role"] == "user" and message["content"].startswith(entry["question"].rstrip())
        assert message["content"].endswith(rg_rows.ANSWER_FORMATS["answer"]) and "<answer>" in message["content"]
    # Train and test ask different questions; in process (this process's hash seed), the same rows.
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in test}
    in_process = rg_rows.make_rows(TASKS, 10, seed=7)[0]
    assert in_process == rg_rows.make_rows(TASKS, 10, seed=7)[0]
    assert [r["messages"] for r in in_process] != [r["messages"] for r in rg_rows.make_rows(TASKS, 10, seed=8)[0]]
    assert in_process[:5] == [row for row in train if row["data_source"] in TASKS][:5]
    # rl2 reads them as RL rows, mixed tasks in one file included.
    rows = load_rows(row_files["train"])
    validate_rows(rows, "rl", row_files["train"])
    assert rows[0]["answer"] == train[0]["answer"] and rows[0]["data_source"] == TASKS[0]


def test_command_errors_are_one_line(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "rows.jsonl")
    assert rg_rows.main(["leg_countin", "--rows", "3", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown reasoning-gym task 'leg_countin' (did you mean leg_counting" in err
    assert not os.path.exists(out)

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "reasoning_gym" else find_spec(name, *args))
    assert rg_rows.main(["gcd", "--rows", "3", "--out", out]) == 2
    assert capsys.readouterr().err == ("rl2: error: reasoning-gym is not installed: pip install 'rl2[envs]' "
                                       "(or pip install reasoning-gym)\n")
    with pytest.raises(EnvError, match=r"reasoning-gym is not installed: pip install 'rl2\[envs\]'"):
        Env(ENV_PATH, workers=0)


def test_env_scores_gold_answers_1_and_others_as_the_task_does():
    env = load_env_file(ENV_PATH, EnvArgs({}))
    partial = []
    for task in TASKS:
        dataset = reasoning_gym.create_dataset(task, seed=rg_rows.task_seed(3, task, "train"), size=4)
        rows = rg_rows.make_rows([task], 4, seed=3)[0]
        for i, row in enumerate(rows):
            entry = dataset[i]  # the entry as generated, not as the row stores it
            assert row["messages"][0]["content"].startswith(entry["question"].rstrip())
            assert env.reward_fn(reply(f"Let me think.\n<answer>{entry['answer']}</answer>"), row["answer"]) == 1.0
            other = dataset[(i + 1) % 4]["answer"]
            for answer in (other, f"{entry['answer']} {other}", f"it is {entry['answer']}", "", "nonsense"):
                expected = dataset.score_answer(answer.strip(), entry)
                got = env.reward_fn(reply(f"<answer> {answer} </answer>"), row["answer"])
                assert got == pytest.approx(expected), (task, answer)
                partial += [got] if 0 < got < 1 else []
            # The last assistant message is scored, its last tag; none: 0.
            assert env.reward_fn(reply(f"<answer>{entry['answer']}</answer> no, <answer>{other}</answer>"),
                                 row["answer"]) == pytest.approx(dataset.score_answer(other, entry))
            assert env.reward_fn(reply(entry["answer"]), row["answer"]) == 0.0
            assert env.reward_fn(reply(f"\\boxed{{{entry['answer']}}}"), row["answer"]) == 0.0
    assert partial, "no partial credit seen"


def test_entries_keep_tuples_for_their_scorers():
    """ARC's scorer compares the parsed grid (tuples) with the entry's: an entry through plain JSON
    (lists) would score the gold answer 0.05."""
    dataset = reasoning_gym.create_dataset("arc_agi", seed=1, size=2)
    entry = dataset[0]
    answer = json.loads(json.dumps(rg_rows.row_answer("arc_agi", entry)))  # as a row file holds it
    assert rg_rows.read_answer(answer) == ("arc_agi", entry)
    assert dataset.score_answer(entry["answer"], json.loads(json.dumps(entry))) == 0.05
    env = load_env_file(ENV_PATH, EnvArgs({}))
    assert env.reward_fn(reply(f"<answer>{entry['answer']}</answer>"), answer) == 1.0
    assert rg_rows.decode_value(rg_rows.encode_value({1: (2, [3]), "__tuple__": 4})) == {1: (2, [3]), "__tuple__": 4}
    assert rg_rows.decode_value(rg_rows.encode_value({"__tuple__": (1,)})) == {"__tuple__": (1,)}


def test_extraction_modes():
    extract = rg_rows.extract_answer
    assert extract("a <answer> 1 </answer> b <answer>\n2\n</answer> c") == "2"
    assert extract("<answer>unclosed") is None and extract("no tags") is None
    assert extract("so \\boxed{\\frac{1}{2}} and \\boxed{3}.", "boxed") == "3"
    assert extract("\\boxed{\\frac{1}{2}}", "boxed") == "\\frac{1}{2}"
    assert extract("\\boxed{4} then \\boxed{5", "boxed") == "4"  # the last box never closes
    assert extract("<answer>6</answer>", "boxed") is None

    row = rg_rows.make_rows(["gcd"], 1, seed=0, answer_format="boxed")[0][0]
    gold = rg_rows.read_answer(row["answer"])[1]["answer"]
    assert row["messages"][0]["content"].endswith(rg_rows.ANSWER_FORMATS["boxed"])
    boxed = load_env_file(ENV_PATH, EnvArgs({"answer_format": "boxed"}))
    default = load_env_file(ENV_PATH, EnvArgs({}))
    assert boxed.reward_fn(reply(f"The gcd is \\boxed{{{gold}}}."), row["answer"]) == 1.0
    assert boxed.reward_fn(reply(f"<answer>{gold}</answer>"), row["answer"]) == 0.0
    assert default.reward_fn(reply(f"The gcd is \\boxed{{{gold}}}."), row["answer"]) == 0.0
    assert default.reward_fn([{"role": "user", "content": "q"}], row["answer"]) == 0.0  # no reply yet
    with pytest.raises(EnvError, match="answer_format='xml'"):
        Env(ENV_PATH, args={"answer_format": "xml"}, workers=0)


def test_per_source_test_metrics(row_files, tiny_model_dir):
    from transformers import AutoTokenizer

    # Sources from the rows' data_source, through the dataset and the rollout, to the test metrics.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    dataset = RLDataset(row_files["test"], tokenizer, max_length=None)
    prompts = [dataset[i] for i in range(len(dataset))]
    assert [p["source"] for p in prompts] == [row["data_source"] for row in read_jsonl(row_files["test"])]
    gold = {p["messages"][0]["content"]: rg_rows.read_answer(p["answer"])[1]["answer"] for p in prompts}

    def answer(text):  # gold answers for gcd, a wrong one elsewhere (chain_sum: gold with text around it)
        question = next(q for q in gold if q in text)
        source = next(p["source"] for p in prompts if p["messages"][0]["content"] == question)
        if source == "gcd":
            return f"<answer>{gold[question]}</answer>"
        return f"<answer>{gold[question]} or so</answer>" if source == "chain_sum" else "<answer>zzz</answer>"

    with Env(ENV_PATH, workers=0) as env:
        trajectories = rollout(ScriptedEngine(tokenizer, answer), env, tokenizer, prompts, 2, SamplingParams())
        assign_rewards(env, trajectories)
    metrics = eval_metrics(trajectories, 2)
    assert metrics["test/gcd/reward_mean"] == 1.0
    score = reasoning_gym.get_score_answer_fn("chain_sum")
    entries = [rg_rows.read_answer(t.answer)[1] for t in trajectories if t.source == "chain_sum"]
    chain_sum = [score(f"{entry['answer']} or so", entry) for entry in entries]  # partial credit
    assert 0 < sum(chain_sum) / len(chain_sum) < 1
    assert metrics["test/chain_sum/reward_mean"] == pytest.approx(sum(chain_sum) / len(chain_sum))
    others = [task for task in TASKS + HASH_SEEDED.split(",") if task not in ("gcd", "chain_sum")]
    assert [metrics[f"test/{task}/reward_mean"] for task in others] == [0.0] * len(others)
    assert metrics["test/reward_mean"] == pytest.approx(sum(t.reward for t in trajectories) / len(trajectories))
    assert trajectories[0].to_json()["source"] == TASKS[0]
    assert Trajectory.from_dict(json.loads(json.dumps(trajectories[0].state()))).source == TASKS[0]  # checkpoints

    # Rows without data_source: no per-source metrics; a source without a scored trajectory: none for it.
    plain = [Trajectory(messages=[], answer=None, group=i, token_ids=[1], action_mask=[0], logprobs=[0.0], reward=r)
             for i, r in enumerate([1.0, 0.0])]
    assert not [key for key in eval_metrics(plain, 1) if key.count("/") > 1]
    plain[0].source, plain[1].source, plain[1].reward = "a", "b", None
    metrics = eval_metrics(plain, 1)
    assert metrics["test/a/reward_mean"] == 1.0 and "test/b/reward_mean" not in metrics


def test_recipe_configs_and_scripts():
    for name in ("config.yaml", "tiny.yaml"):
        path = os.path.join(REPO, "recipes", "reasoning_gym", name)
        config = load_config([f"config={path}", "data.path=train.jsonl", "data.test_path=test.jsonl",
                              "actor.model_name=" + (load_config([f"config={path}"]).actor.model_name or "tiny")])
        check_config(config, "ppo")
        assert config.rollout.env_path == "envs/reasoning_gym.py"
        assert config.rollout.env_args == {"answer_format": "answer"}
    for name in ("run.sh", "tiny.sh"):
        script = os.path.join(REPO, "recipes", "reasoning_gym", name)
        assert subprocess.run(["bash", "-n", script]).returncode == 0
        assert "python -m rl2.data.reasoning_gym" in open(script).read()


def test_grpo_on_two_ranks(row_files, tiny_model_dir, tmp_path):
    """tiny.sh's GRPO run (without its warm-up): 2 steps on 2 ranks, the env file in worker processes,
    evaluated at steps 0 and 2 with a test metric per task."""
    save_dir = str(tmp_path / "grpo")
    run_torchrun(["-m", "rl2.trainer.ppo", "config=recipes/reasoning_gym/tiny.yaml",
                  f"actor.model_name={tiny_model_dir}", f"data.path={row_files['train']}",
                  f"data.test_path={row_files['test']}", f"actor.save_dir={save_dir}", "trainer.total_steps=2",
                  "data.prompts_per_rollout=2", "data.responses_per_prompt=2",
                  "rollout.train_sampling_params.max_new_tokens=8", "rollout.test_sampling_params.max_new_tokens=8"])
    rows = read_metrics(os.path.join(save_dir, "metrics.jsonl"))
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2]
    tests = [row for row in rows if "test/reward_mean" in row]
    assert [row["step"] for row in tests] == [0, 2]
    for row in tests:
        assert row["test/reward_errors"] == 0 and row["test/env_errors"] == 0
        assert {key for key in row if key.endswith("/reward_mean")} == {
            "test/reward_mean", *(f"test/{task}/reward_mean" for task in TASKS + HASH_SEEDED.split(","))}
    assert all(row.get("env_errors", 0) == 0 and row.get("reward_errors", 0) == 0 for row in rows)
    dumped = read_jsonl(os.path.join(save_dir, "trajectories", "test_step_0.jsonl"))
    assert sorted(t["source"] for t in dumped) == sorted(row["data_source"] for row in read_jsonl(row_files["test"]))
