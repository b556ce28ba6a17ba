"""A mistake a user can fix is one `rl2: error:` line with exit code 2, from rank 0 only; Ctrl-C is
one line saying where to resume, exit code 130; keys a command does not read are errors naming the
command; each command's --help lists what it reads; help texts say what the code does."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import fields, is_dataclass

import pytest
import torch

from conftest import REPO, run_python, run_torchrun
from rl2.config import Config, ConfigError, config_help, load_config
from rl2.config.commands import COMMANDS, DPO, IMAGES, POLICY_LOSS, RL, SAMPLING, TRAINING
from rl2.config_checks import check_config
from rl2.engines.base import SamplingParams
from rl2.rollout.env import Env, EnvResult
from test_run_folder import write_sft_rows
from test_sft import run_python_raw


def sft_command(model_dir: str, data: str, save_dir: str, *extra: str, batch_size: int = 4) -> list[str]:
    return ["-m", "rl2.trainer.sft", f"data.path={data}", f"data.batch_size={batch_size}", f"actor.model_name={model_dir}",
            "actor.dtype=float32", "actor.max_length_per_device=96", "actor.gradient_checkpointing=false",
            f"actor.save_dir={save_dir}", "trainer.disable_wandb=true", *extra]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "rl2: error:" in line]


# ---- keys a command does not read ------------------------------------------------------------

@pytest.mark.parametrize("command, args, named, hint", [
    ("rm", ["actor.save_dir=my_rm"], ["actor.save_dir"], "did you mean critic.save_dir?"),
    ("sft", ["critic.lr=5", "kl.coef=1", "rollout.max_turns=4"], ["critic.lr", "kl.coef", "rollout.max_turns"],
     "did you mean actor.lr?"),
    ("sft", ["actor.clip=0.3", "actor.update_per_rollout=2"], ["actor.clip", "actor.update_per_rollout"], None),
    ("sft", ["actor.kl.coef=0.1"], ["actor.kl.coef (rl2's kl.coef)"], None),
    ("dpo", ["adv.estimator=gae", "trainer.eval_only=true"], ["adv.estimator", "trainer.eval_only"], None),
    ("ppo", ["filter.output=x.jsonl", "actor.beta=0.2"], ["filter.output", "actor.beta"], None),
    ("filter", ["kl.coef=0.1", "actor.lr=1e-5", "trainer.disable_wandb=true"],
     ["kl.coef", "actor.lr", "trainer.disable_wandb"], None),
    ("search", ["filter.output=x.jsonl", "critic.model_name=m"], ["filter.output", "critic.model_name"],
     "did you mean actor.model_name?"),
])
def test_a_key_the_command_does_not_read_is_an_error_naming_the_command(command, args, named, hint):
    with pytest.raises(ConfigError) as error:
        load_config(args, command)
    message = str(error.value)
    assert message.startswith(f"{COMMANDS[command].module} does not read {', '.join(named)}"), message
    assert (hint in message) if hint else "did you mean" not in message
    load_config(args)  # without a command (a notebook's Config, for any trainer) the keys are fine


def test_keys_a_yaml_file_sets_for_other_commands_are_one_note(tmp_path, capsys):
    """A recipe's YAML serves several commands: what this one does not read is named, not refused."""
    path = tmp_path / "recipe.yaml"
    path.write_text("actor: {lr: 1.0e-5}\nkl: {coef: 0.1}\nadv: {estimator: gae}\n")
    config = load_config([f"config={path}"], "sft")
    assert config.actor.lr == 1e-5
    [note] = capsys.readouterr().err.strip().splitlines()
    assert note == f"rl2: {path} sets keys that rl2.trainer.sft does not read (they change nothing here): kl.coef, adv.estimator"


def test_every_key_a_command_reads_exists():
    """The table names real keys: a renamed key would otherwise silently leave a command's table."""
    sections = {f.name: {g.name for g in fields(f.type)} for f in fields(Config)}
    for command in COMMANDS.values():
        for key in (*command.reads, *command.ignores):
            section, _, name = key.partition(".")
            assert section in sections and (not name or name in sections[section]), (command.name, key)


def test_every_tag_is_one_the_commands_know():
    """A key's `only` tag is one of rl2.config.commands' (a misspelt one would leave the key read everywhere),
    and every tag a command skips is one some key carries."""
    known = {SAMPLING, TRAINING, RL, POLICY_LOSS, DPO, IMAGES}

    def tags(cls):
        for f in fields(cls):
            yield f.metadata.get("only")
            yield from tags(f.type) if is_dataclass(f.type) else ()

    used = set(tags(Config)) - {None}
    assert used == known
    assert all(set(command.skips) <= known for command in COMMANDS.values())


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_lists_what_the_command_reads(command, capsys):
    reader = COMMANDS[command]
    with pytest.raises(SystemExit) as exit_:
        load_config(["--help"], command)
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text == config_help(command=command) + "\n"
    assert text.startswith(f"usage: torchrun --nproc_per_node=N -m {reader.module} ")
    keys = re.findall(r"^  ([a-z_]+\.[a-z0-9_.]+):", text, re.MULTILINE)

    def leaf_keys(cls, prefix):  # nested sections (actor.lora) by their keys
        for g in fields(cls):
            name = f"{prefix}.{g.name}"
            yield from leaf_keys(g.type, name) if is_dataclass(g.type) else [name]

    expected = [key for f in fields(Config) for key in leaf_keys(f.type, f.name) if reader.reads_key(key)]
    assert keys == expected
    headers = re.findall(r"^([a-z_]+): ", text, re.MULTILINE)[1:]  # after "usage:"
    assert headers == [f.name for f in fields(Config) if reader.reads_section(f.name)]


def test_help_per_command_examples():
    def keys(command: str) -> set[str]:
        return set(re.findall(r"^  ([a-z_]+\.[a-z0-9_]+):", config_help(command=command), re.MULTILINE))

    assert "critic.save_dir" in keys("rm") and not any(key.startswith("actor.") for key in keys("rm"))
    assert not any(key.startswith(("rollout.", "critic.", "kl.")) for key in keys("sft"))
    assert "actor.lr" in keys("sft") and not {"actor.clip", "actor.beta"} & keys("sft")
    assert "actor.beta" in keys("dpo") and "filter.output" in keys("filter")


# ---- help texts say what the code does ----------------------------------------------------

def _help_line(key: str) -> str:
    [line] = [line for line in config_help().splitlines() if line.startswith(f"  {key}:")]
    return line


def test_sampling_params_help_names_exactly_the_keys_the_engines_take(tiny_model_dir):
    text = _help_line("rollout.train_sampling_params").split("—", 1)[1]
    listed = re.findall(r"\b([a-z]+(?:_[a-z]+)*)\b", text.split(":", 1)[1].split(";")[0])
    named = [word for word in listed if word in {f.name for f in fields(SamplingParams)} or "_" in word]
    assert named == [f.name for f in fields(SamplingParams)], text
    assert "another key is an error" in text
    config = load_config([f"actor.model_name={tiny_model_dir}", "data.path=x.jsonl", "rollout.env_path=env.py",
                          "rollout.train_sampling_params={max_new_token: 8}"])
    with pytest.raises(ConfigError, match="rollout.train_sampling_params: unknown sampling parameter 'max_new_token'"):
        check_config(config, "ppo")


def test_env_timeout_help_says_the_trajectory_gets_no_reward(tmp_path):
    text = _help_line("rollout.env_timeout")
    assert "no reward (null)" in text and "left out of the update" in text and "reward 0" not in text
    path = tmp_path / "slow_env.py"
    path.write_text("import time\n\ndef reward_fn(messages, answer):\n    time.sleep(5)\n    return 1.0\n")
    with Env(str(path), timeout=0.2, workers=0) as env:
        [result] = env.rewards([[{"role": "user", "content": "hi"}]], [None])
    assert result == EnvResult(None, "reward_fn timed out after 0.2s")


# ---- one line on the command line --------------------------------------------------------

def test_a_typo_in_the_sampling_params_is_one_line(tiny_model_dir, tmp_path):
    result = run_python_raw(["-m", "rl2.trainer.ppo", f"actor.model_name={tiny_model_dir}", "data.path=x.jsonl",
                             "rollout.env_path=envs/demo_successor.py",
                             "rollout.train_sampling_params={temperature: 1.0, max_new_token: 8}"])
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "rl2: error: rollout.train_sampling_params: unknown sampling parameter 'max_new_token'; did you mean "
        "max_new_tokens?; valid ones: "
        "temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids, ignore_eos"], result.stderr


def test_a_batch_larger_than_the_data_and_a_broken_checkpoint_are_one_line(tiny_model_dir, tmp_path):
    data = write_sft_rows(tmp_path / "rows.jsonl", 6)
    too_big = run_python_raw(sft_command(tiny_model_dir, data, str(tmp_path / "a"), "data.test_ratio=0",
                                         batch_size=10))
    assert too_big.returncode == 2 and "Traceback" not in too_big.stderr
    assert error_lines(too_big.stderr) == [
        f"rl2: error: data.batch_size=10 is larger than the 6 training rows of {data}: no batch fills; lower data.batch_size"]

    save_dir = tmp_path / "b"
    run_python(sft_command(tiny_model_dir, data, str(save_dir), "trainer.total_steps=1", "data.test_ratio=0"))
    os.remove(save_dir / "step1" / "trainer_state.json")  # as a save cut short leaves it
    incomplete = run_python_raw(sft_command(tiny_model_dir, data, str(save_dir), "trainer.total_steps=2",
                                            f"trainer.load_ckpt_from={save_dir / 'step1'}", "data.test_ratio=0"))
    assert incomplete.returncode == 2 and "Traceback" not in incomplete.stderr
    assert error_lines(incomplete.stderr) == [
        f"rl2: error: trainer.load_ckpt_from={save_dir / 'step1'} is not a complete checkpoint: trainer_state.json, "
        "written last when a save completes, is missing"]

    other = tmp_path / "other"  # a checkpoint of another model (another hidden size)
    from rl2.testing.tiny import save_tiny
    save_tiny(str(other), hidden_size=32)
    run_python(sft_command(str(other), data, str(tmp_path / "c"), "trainer.total_steps=1", "data.test_ratio=0"))
    mismatch = run_python_raw(sft_command(tiny_model_dir, data, str(tmp_path / "c"), "trainer.total_steps=2",
                                          "trainer.load_ckpt_from=latest", "data.test_ratio=0"))
    assert mismatch.returncode == 2 and "Traceback" not in mismatch.stderr
    [line] = error_lines(mismatch.stderr)
    assert line.startswith(f"rl2: error: cannot resume from {tmp_path / 'c' / 'step1'}: Size mismatch"), line


def test_two_ranks_say_a_config_error_once(tiny_model_dir, tmp_path):
    data = write_sft_rows(tmp_path / "rows.jsonl", 6)
    result = run_torchrun(sft_command(tiny_model_dir, data, str(tmp_path / "a"), "critic.lr=1"), check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert error_lines(result.stderr) == [
        "rl2: error: rl2.trainer.sft does not read critic.lr; did you mean actor.lr? (it reads keys of: data, actor, "
        "trainer; python -m rl2.trainer.sft --help lists them)"]


PEER_EXITS = """
import os
import time

import torch.distributed as dist

from rl2.trainer.base import run_main


def run(config):
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(0)  # leaves without a word, while rank 0 still needs it
    time.sleep(0.5)
    dist.all_reduce(__import__("torch").zeros(1))


run_main(run, "sft")
"""


def test_a_rank_whose_peer_exited_says_so_with_its_rank(tmp_path):
    """A rank that loses a peer mid-collective does not exit 1 silently: one line names it, the call that
    met the closed connection and gloo's message."""
    script = tmp_path / "peer_exits.py"
    script.write_text(PEER_EXITS)
    result = run_torchrun([str(script)], check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("rl2 [rank")]
    assert re.match(rf"rl2 \[rank 0\]: stopped: another rank exited while this one still worked with it in run "
                    rf"\({re.escape(str(script))}:16\): .*Connection (closed|reset) by peer", line), line
    assert f'File "{script}"' not in result.stderr  # no traceback of the rank's (torchrun adds its own report)


def test_a_retrieval_server_on_a_taken_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "rl2.tools.retrieval_server", "--corpus", "recipes/data/search_corpus.jsonl",
             "--port", str(port)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"python -m rl2.tools.retrieval_server: error: cannot serve on 127.0.0.1:{port}: [Errno 98]")


# ---- rl2run: torchrun without its report after rl2's own line --------------------------------

def rl2run(args: list[str], cwd: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": REPO}
    return subprocess.Popen([sys.executable, "-m", "rl2.launch", "--standalone", "--nproc_per_node=2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env, **kwargs)


@pytest.mark.xdist_group("real_launches")
def test_rl2run_adds_nothing_to_a_user_error(tiny_model_dir, tmp_path):
    data = write_sft_rows(tmp_path / "rows.jsonl", 6)
    process = rl2run(sft_command(tiny_model_dir, data, str(tmp_path / "a"), "data.test_ratio=0", batch_size=10),
                     str(tmp_path))
    out, err = process.communicate(timeout=300)
    assert process.returncode == 2, err
    # rank 0 logs what it read (its info log, and datasets' progress bar); then the one line
    lines = [line for line in err.splitlines() if line.strip() and "rl2.data.rows" not in line
             and not line.startswith("Generating train split")]
    assert lines == [f"rl2: error: data.batch_size=10 is larger than the 6 training rows of {data}: no batch fills; "
                     "lower data.batch_size"], err


@pytest.mark.xdist_group("real_launches")
def test_ctrl_c_stops_every_rank_with_one_line_and_the_run_resumes(tiny_model_dir, tmp_path):
    """SIGINT to the launcher (what Ctrl-C in a terminal does: the ranks run in sessions of their own and
    get it from the launcher) stops both ranks; rank 0 says where the last checkpoint is; resuming from
    it continues."""
    data = write_sft_rows(tmp_path / "rows.jsonl", 16)
    save_dir = tmp_path / "run"
    args = sft_command(tiny_model_dir, data, str(save_dir), "trainer.total_steps=100000", "actor.save_freq=2",
                       "data.test_ratio=0")
    process = rl2run(args, str(tmp_path))
    deadline = time.monotonic() + 240
    while not (save_dir / "step4" / "trainer_state.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err
    [line] = [line for line in err.splitlines() if line.startswith("rl2:")]
    latest = max(int(name[4:]) for name in os.listdir(save_dir)
                 if name.startswith("step") and (save_dir / name / "trainer_state.json").exists())
    assert line == f"rl2: interrupted; the last checkpoint is {save_dir / f'step{latest}'}: resume with " \
                   "trainer.load_ckpt_from=latest", err[-2000:]
    resumed = run_torchrun([*args[:-3], f"trainer.total_steps={latest + 1}", "data.test_ratio=0",
                            "trainer.load_ckpt_from=latest"], cwd=str(tmp_path))
    assert f"resumed from {save_dir / f'step{latest}'} at step {latest}" in resumed.stderr
    steps = [json.loads(line)["step"] for line in open(save_dir / "metrics.jsonl")]
    assert steps[-1] == latest + 1


# ---- the critic in bf16 -------------------------------------------------------------------

def test_critic_gradients_in_bf16_match_fp32_and_no_view_warning(tiny_model_dir, tmp_path):
    """FSDP2 warned that the critic's output is a view (an in-place op on it would skip the all-gather
    before backward). Its head now returns a tensor of its own; the gradients of a clipped value loss
    equal a plain fp32 transformers reference (float32: to rounding; bfloat16: to bf16's precision)."""
    out = tmp_path / "grads.pt"
    run_python(["tests/workers/critic_grads.py", tiny_model_dir, str(out)])
    results = torch.load(out)
    reference = results["reference"]
    for dtype, tolerance in (("float32", 1e-5), ("bfloat16", 0.05)):
        grads = results[dtype]["grads"]
        assert grads.keys() == reference.keys()
        assert not [w for w in results[dtype]["warnings"] if "view" in w], results[dtype]["warnings"]
        for name, expected in reference.items():
            error = (grads[name].double() - expected.double()).norm() / expected.double().norm()
            assert error < tolerance, (dtype, name, error.item())


# ---- smaller things a new user meets ------------------------------------------------------

def test_dir_lists_the_trainers():
    import rl2

    assert {"SFTTrainer", "PPOTrainer", "RMTrainer", "DPOTrainer", "load_config"} <= set(dir(rl2))


def test_no_env_file_is_named_like_a_standard_module():
    """A file in envs/ named like a standard module (envs/math.py was) shadows it for any script run from
    envs/ or with envs/ on sys.path."""
    names = {name[:-3] for name in os.listdir(os.path.join(REPO, "envs")) if name.endswith(".py")}
    assert not names & sys.stdlib_module_names
