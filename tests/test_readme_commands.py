"""The README's and the docs' commands as a user copies them: every rl2 command line parses under its command (its
keys exist and are read by it), the make targets and tiny recipes it calls CPU runs are the ones the suite runs,
and the code-service request gets the answer shown. (Every other kind of block and line: test_docs.py; the
notebook lines: test_readme_notebook.py; the demos: test_ppo.py's demo test and test_recipes.py's tiny variants.)"""

import json
import os
import re
import shlex
import shutil
import subprocess

import pytest

from conftest import REPO
from docs_blocks import command_lines, doc_files, key_values, python_module
from rl2.config import load_config
from rl2.config.commands import COMMANDS
from server_process import ServerProcess

MODULES = {command.module: name for name, command in COMMANDS.items()}
LAUNCHERS = ("torchrun", "rl2run")


def rl2_command_lines() -> list[tuple[str, str, list[str]]]:
    """(where, command, key=value arguments) of each line that runs an rl2 command; a `torchrun ... key=value`
    line that elides its module gives RL keys, read as `rl2.trainer.ppo`'s."""
    commands = []
    for line in command_lines():
        words = line.command
        module = python_module(words)
        if module in MODULES:
            commands.append((line.block.where, MODULES[module], key_values(words, module)))
        elif words and words[0] in LAUNCHERS and module is None:
            commands.append((line.block.where, "ppo", key_values(words, None)))
    return commands


def test_the_docs_have_their_commands():
    names = [name for _, name, _ in rl2_command_lines()]
    assert {"ppo", "sft", "rm", "dpo", "filter", "search"} <= set(names), names


@pytest.mark.parametrize("where, command, args", rl2_command_lines(),
                         ids=[f"{where}-{command}" for where, command, _ in rl2_command_lines()])
def test_every_command_line_parses_under_its_command(where, command, args, monkeypatch):
    """Unknown keys, bad values and keys the command does not read would each stop the user's run."""
    monkeypatch.chdir(REPO)  # config=recipes/... is relative to the repository, where the docs run it
    load_config(args, command)


def test_the_cpu_runs_the_docs_name_are_the_suites():
    """`make` targets the README and the docs name exist; each `TINY=1 bash recipes/<r>/train.sh` they call CPU
    runs is run by test_recipes.py."""
    targets = set(re.findall(r"^([a-z-]+):", open(os.path.join(REPO, "Makefile")).read(), re.MULTILINE))
    text = "".join(open(os.path.join(REPO, path)).read() for path in doc_files())
    named = set(re.findall(r"`make ([a-z-]+)`", text)) | {line.command[1] for line in command_lines()
                                                           if line.command[:1] == ["make"]}
    assert named and named <= targets, named - targets
    tiny = {re.search(r"recipes/(\w+)/train.sh", line.text).group(1) for line in command_lines()
            if "TINY=1" in line.words and "bash" in line.command}
    tested = set(re.findall(r"def test_(\w+)_tiny_variant", open(os.path.join(REPO, "tests", "test_recipes.py")).read()))
    assert tiny and tiny <= tested, tiny - tested


def curl_request() -> tuple[str, dict]:
    """The one curl command of the docs and the answer shown under it (`# {...}`)."""
    [curl] = [line for line in command_lines() if line.command[:1] == ["curl"]]
    shown = next(line for line in curl.block.text.splitlines() if line.startswith("# {"))
    return curl.text, json.loads(shown[2:])


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_code_service_request_gets_the_answer_it_shows():
    curl, shown = curl_request()
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
