"""The recipes under recipes/: every YAML is a valid config, the GPU configs say what their papers
did, and each recipe's tiny CPU variant runs end to end (data script, warm-up, real tool
processes, training steps, evaluation)."""

import contextlib
import glob
import json
import os
import signal
import subprocess

import pytest

from conftest import FORK_RANKS, REPO, kill_tree
from rl2.config import load_config
from rl2.config_checks import check_config
from rl2.metrics import read_metrics
from torchrun_service import TorchrunService

RECIPE_YAMLS = sorted(glob.glob(os.path.join(REPO, "recipes", "**", "*.yaml"), recursive=True))


RECIPE_COMMANDS = {"rstar2_agent": "ppo", "search_r1": "ppo", "math_grpo": "ppo", "rstar_math": "search"}


def test_recipes_launch_torchrun_on_a_free_port():
    """Every recipe's torchrun (or `python -m torch.distributed.run`, the PATH's python's, or `$TORCHRUN`) is --standalone: its
    default static rendezvous port (29500) made two recipes on one machine (or two of the suite's recipe tests
    at once) fail with EADDRINUSE."""
    launches = []
    for path in sorted(glob.glob(os.path.join(REPO, "recipes", "**", "*.sh"), recursive=True)):
        with open(path) as file:
            launches += [(path, line.strip()) for line in file
                         if line.strip().startswith(("torchrun ", "python -m torch.distributed.run ", "$TORCHRUN "))]
    assert len(launches) >= 10
    assert [launch for launch in launches if "--standalone" not in launch[1]] == []


@pytest.mark.parametrize("path", RECIPE_YAMLS, ids=lambda p: os.path.relpath(p, REPO))
def test_every_recipe_yaml_is_a_valid_config(path):
    """A recipe can never drift from the code: an unknown key or a bad value fails here, and so do
    settings its command refuses (e.g. GRPO-RoC keeping more responses than it generates)."""
    config = load_config([f"config={path}"])
    assert config.rollout.env_path is None or os.path.isfile(os.path.join(REPO, config.rollout.env_path))
    recipe = os.path.basename(os.path.dirname(path))
    if recipe in RECIPE_COMMANDS:  # the data comes from prepare_data.py, and a tiny run's model from train.sh
        config = load_config([f"config={path}", "data.path=train.jsonl", "data.test_path=test.jsonl",
                              "actor.model_name=" + (config.actor.model_name or "Qwen/Qwen2.5-0.5B-Instruct")])
        check_config(config, RECIPE_COMMANDS[recipe])


def run_tiny(recipe: str, out: str, **env: str) -> str:
    """`TINY=1 bash recipes/<recipe>/train.sh` into `out`; returns its output. The output goes to a
    file, not a pipe, so a process left behind cannot keep the test waiting."""
    environment = {**os.environ, "TINY": "1", "OUT": out, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
                   "PYTHONPATH": REPO, **env}
    log = os.path.join(out, "train.log")
    os.makedirs(out, exist_ok=True)
    with TorchrunService() if FORK_RANKS else contextlib.nullcontext() as shim, open(log, "w") as f:
        if shim:  # its torchrun forks the ranks from preloaded modules
            environment["PATH"] = shim + os.pathsep + environment["PATH"]
        process = subprocess.Popen(["bash", f"recipes/{recipe}/train.sh"], stdout=f, stderr=subprocess.STDOUT,
                                   env=environment, cwd=REPO, start_new_session=True)
        try:
            returncode = process.wait(timeout=600)
        finally:
            if process.poll() is None:  # torchrun's ranks run in sessions of their own: the whole tree
                kill_tree(process.pid)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    output = open(log).read()
    assert returncode == 0, output[-8000:]
    return output


def trajectories(folder: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "trajectories", "step_*.jsonl"))):
        rows += [json.loads(line) for line in open(path)]
    return rows


def tool_messages(rows: list[dict]) -> list[str]:
    return [m["content"] for row in rows for m in row["messages"] if m["role"] == "tool"]


def check_eval(out: str, k: int) -> dict:
    report = json.load(open(os.path.join(out, "eval", "eval.json")))
    assert report["k"] == k and 0.0 <= report[f"test/avg@{k}"] <= report[f"test/pass@{k}"] <= 1.0
    return report


def test_rstar2_agent_tiny_variant(tmp_path):
    """Stage 1 (1 step) -> difficulty filter -> stage 3 (1 step, longer responses) -> eval, with
    the code run by the built-in code-judge service; GRPO-RoC metrics logged."""
    out = str(tmp_path)
    run_tiny("rstar2_agent", out, EXECUTOR="code-judge")
    assert "code service ready" in open(os.path.join(out, "code_server.log")).read()
    for stage in ("stage1", "stage3"):
        rows = read_metrics(os.path.join(out, stage, "metrics.jsonl"))
        step = [row for row in rows if row["step"] == 1][0]
        assert step["roc/kept_trajectories"] >= 0 and "roc/tool_error_rate_before" in step
        assert os.path.isfile(os.path.join(out, stage, "step1", "config.json"))
        generated = trajectories(os.path.join(out, stage))
        assert len(generated) == 4 * 8  # prompts_per_rollout x rollout.oversample
        assert max(t["response_length"] for t in generated) > 0
    # The warmed-up model calls the tool; the service ran the programs (their real output is shown).
    outputs = tool_messages(trajectories(os.path.join(out, "stage1")) + trajectories(os.path.join(out, "stage3")))
    assert outputs, "no tool call reached the code service"
    assert any(message.strip() and "rror" not in message for message in outputs), outputs[:5]
    rates = [json.loads(line) for line in open(os.path.join(out, "data", "train_hard.jsonl.pass_rates.jsonl"))]
    kept = [json.loads(line) for line in open(os.path.join(out, "data", "train_hard.jsonl"))]
    assert len(rates) == 12 and len(kept) == sum(r["kept"] for r in rates) > 0
    check_eval(out, 2)


def test_search_r1_tiny_variant(tmp_path):
    """The retrieval server on the shipped corpus, 2 GRPO steps with the KL loss, then eval; the
    model's searches reach the server and come back with its documents."""
    out = str(tmp_path)
    run_tiny("search_r1", out)
    assert "retrieval server ready" in open(os.path.join(out, "retrieval_server.log")).read()
    rows = read_metrics(os.path.join(out, "grpo", "metrics.jsonl"))
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2]
    assert all("actor/kl_loss" in row for row in rows if "reward/mean" in row)
    outputs = tool_messages(trajectories(os.path.join(out, "grpo")))
    assert any(message.startswith("<information>Doc 1(Title:") for message in outputs), outputs[:5]
    assert not any("The search failed" in message for message in outputs)
    check_eval(out, 2)


def test_math_grpo_tiny_variant(tmp_path):
    out = str(tmp_path)
    run_tiny("math_grpo", out)
    rows = read_metrics(os.path.join(out, "grpo", "metrics.jsonl"))
    assert [row["step"] for row in rows if "reward/mean" in row] == [1, 2]
    assert len(trajectories(os.path.join(out, "grpo"))) == 2 * 4 * 4
    check_eval(out, 2)


def test_rstar_math_tiny_variant(tmp_path):
    """Round 1 terminal-guided MCTS on 2 ranks -> SFT of the policy and the PPM on its rows -> round 2
    PPM-guided MCTS -> greedy / best-of-N / beam / MCTS evaluation; every problem searched once, by
    one rank, and the steps' programs run in the sandbox."""
    out = str(tmp_path)
    run_tiny("rstar_math", out)
    for round_ in ("round1", "round2"):
        solutions = [json.loads(line) for line in open(os.path.join(out, round_, "mcts", "solutions.jsonl"))]
        assert [s["row"] for s in solutions] == list(range(1, 17))  # both ranks' problems, in order
        trees = [json.loads(line)["tree"] for line in open(os.path.join(out, round_, "mcts", "trees.jsonl"))]
        assert all(tree["visits"] == 4 for tree in trees)  # search.rollouts
    pairs = [json.loads(line) for line in open(os.path.join(out, "round1", "mcts", "ppm_pairs.jsonl"))]
    sft = [json.loads(line) for line in open(os.path.join(out, "round1", "mcts", "sft.jsonl"))]
    assert pairs and sft and all(row["chosen"] != row["rejected"] for row in pairs)
    assert any("```output\n" in row["messages"][-1]["content"] for row in sft)  # a program ran and printed
    assert os.path.isfile(os.path.join(out, "ppm1", "step4", "config.json"))
    report = json.load(open(os.path.join(out, "eval", "report.json")))
    assert report["ppm"].endswith("ppm1/step4") and list(report["modes"]) == ["greedy", "best_of_n", "beam", "mcts"]
    for mode, figures in report["modes"].items():
        assert figures["problems"] == 8 and 0 <= figures["accuracy"] <= figures["solved"] <= 1, mode
        assert figures["tokens_per_problem"] > 0, mode
    assert report["modes"]["greedy"]["tokens_per_problem"] < report["modes"]["best_of_n"]["tokens_per_problem"]
