"""The README's commands as a user copies them: every rl2 command line parses under its command (its keys
exist and are read by it), the make targets and tiny recipes it calls CPU runs are the ones the suite runs,
and its code-service request gets the answer it shows. (The notebook lines: test_readme_notebook.py; the
demos: test_ppo.py's demo test and test_recipes.py's tiny variants.)"""

import json
import os
import re
import shlex
import shutil
import subprocess

import pytest

from conftest import REPO
from rl2.config import load_config
from rl2.config.commands import COMMANDS
from server_process import ServerProcess

MODULES = {command.module: name for name, command in COMMANDS.items()}


def readme_bash_lines() -> list[str]:
    """Every line of the README's bash blocks, continuation lines joined, comments dropped."""
    text = open(os.path.join(REPO, "README.md")).read()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def rl2_command_lines() -> list[tuple[str, list[str]]]:
    """(command, key=value arguments) of each README line that runs an rl2 command."""
    commands = []
    for line in readme_bash_lines():
        words = shlex.split(line)
        if "-m" not in words or words[words.index("-m") + 1] not in MODULES:
            continue  # not a command that reads a config (a service takes --flags, tested with it)
        module = words[words.index("-m") + 1]
        args = [word for word in words[words.index("-m") + 2:] if "=" in word and not word.startswith("-")]
        commands.append((MODULES[module], args))
    return commands


def test_the_readme_has_its_commands():
    names = [name for name, _ in rl2_command_lines()]
    assert {"ppo", "sft", "rm", "dpo", "filter", "search"} <= set(names), names


@pytest.mark.parametrize("command, args", rl2_command_lines(), ids=lambda value: value if isinstance(value, str) else "")
def test_every_readme_command_line_parses_under_its_command(command, args):
    """Unknown keys, bad values and keys the command does not read would each stop the user's run."""
    load_config(args, command)


def test_the_readme_cpu_runs_are_the_suites():
    """`make` targets the README names exist; each `TINY=1 bash recipes/<r>/train.sh` it calls CPU runs is
    run by test_recipes.py."""
    targets = set(re.findall(r"^([a-z-]+):", open(os.path.join(REPO, "Makefile")).read(), re.MULTILINE))
    text = open(os.path.join(REPO, "README.md")).read()
    named = set(re.findall(r"`make ([a-z-]+)`", text)) | {line.split()[1] for line in readme_bash_lines()
                                                           if line.startswith("make ")}
    assert named and named <= targets, named - targets
    tiny = {re.search(r"recipes/(\w+)/train.sh", line).group(1) for line in readme_bash_lines()
            if line.startswith("TINY=1") or " TINY=1 " in f" {line}"}
    tested = set(re.findall(r"def test_(\w+)_tiny_variant", open(os.path.join(REPO, "tests", "test_recipes.py")).read()))
    assert tiny and tiny <= tested, tiny - tested


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_readme_code_service_request_gets_the_answer_it_shows():
    text = open(os.path.join(REPO, "README.md")).read()
    [curl] = [line for line in readme_bash_lines() if line.startswith("curl ")]
    shown = json.loads(text[text.index("# {", text.index("curl -s localhost:8000/run")) + 2:].splitlines()[0])
    key = "readme-test-key"
    server = ServerProcess("rl2.tools.code_server", ["--host", "127.0.0.1", "--port", "0", "--workers", "1"],
                           r"code service ready at (http://\S+)", "code server", env={"CODE_SERVER_API_KEY": key})
    try:
        url = server.wait_ready(60)
        curl = curl.replace("localhost:8000", url.removeprefix("http://")).replace("$CODE_SERVER_API_KEY", key)
        result = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=60)
    finally:
        server.stop()
    answer = json.loads(result.stdout)
    assert answer.keys() == shown.keys()
    assert {k: v for k, v in answer.items() if k not in ("sub_id", "cost")} == {
        k: v for k, v in shown.items() if k not in ("sub_id", "cost")}
