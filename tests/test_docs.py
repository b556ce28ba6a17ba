"""The documentation: README.md and docs/ (the mkdocs site).

- The site builds with `mkdocs build --strict` (a broken link or anchor, a page left out of the nav, a missing
  Python reference fails), offline: nothing in it loads from another host.
- Every code block of the README and the docs is either run here (or by the test its marker names) or parsed:
  Python compiles, YAML goes through the config loader under its command, data rows through the data checks,
  every bash line is a command this file knows how to check (rl2 commands: test_readme_commands.py).
- The config reference has every key of the config dataclasses with its default and the commands that read it;
  the metrics page documents every name the trainers log (the quickstart's run here, the notebook's in
  test_readme_notebook.py, more where other tests read metrics) and no name the code does not log.
"""

import ast
import contextlib
import glob
import importlib
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import sys
from argparse import ArgumentParser

import datasets
import pytest

import rank_launcher
from conftest import REPO, forked_or_real, run_torchrun
from docs_blocks import (
    all_blocks, assert_metrics_documented, blocks_marked, command_lines, doc_files, documented_metrics,
    metric_pattern, python_module, undocumented_metrics,
)
from rl2.config import Config, config_entries, config_help, load_config
from rl2.config.commands import COMMANDS
from rl2.config.rl2_keys import RL2_KEYS
from rl2.data.rows import Columns, validate_rows
from rl2.metrics import read_metrics

LANGUAGES = {"bash", "python", "yaml", "jsonc", "text"}
MARKERS = {"gpu", "test", "config", "rows", "output"}
# The blocks that tests run, by the name in their `<!-- test: NAME -->` marker, and the tests that run them.
RUN_BY = {"quickstart": "test_docs.py", "notebook": "test_readme_notebook.py", "sandbox": "test_docs.py",
          "hermes-call": "test_docs.py", "countdown-port": "test_rl2_scripts.py", "agent": "test_agent_example.py"}
OUTPUTS = {"rl2-notes", "layout", "ppo-step"}
# Commands whose flags an argparse parser reads (`python -m M --flag ...`): parsed by that parser here.
ARGPARSE_MODULES = {"rl2.tools.code_server", "rl2.tools.retrieval_server", "rl2.testing.tiny", "rl2.report",
                    "rl2.data.reasoning_gym"}
RL2_MODULES = {command.module for command in COMMANDS.values()}


def load_hook():
    """docs/gen_config_reference.py, the mkdocs hook that generates the config reference pages."""
    spec = importlib.util.spec_from_file_location("gen_config_reference", os.path.join(REPO, "docs", "gen_config_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the site -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
    """The site built strict into a temporary folder."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' (make install does)")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": REPO}
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return str(out)


@pytest.mark.xdist_group("docs_site")  # one worker builds the site for the tests that read it
def test_the_site_builds_strict_with_every_page(site):
    nav_pages = re.findall(r":\s*([\w/.-]+\.md)\s*$", open(os.path.join(REPO, "mkdocs.yml")).read(), re.MULTILINE)
    for page in nav_pages:
        built = "index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html"
        assert os.path.isfile(os.path.join(site, built)), page
    reference = open(os.path.join(site, "reference", "config", "index.html")).read()
    assert "actor.lora.rank" in reference and "rollout.partial_rollout" in reference
    api = open(os.path.join(site, "reference", "python-api", "index.html")).read()
    assert "load_config" in api and "RewardScorer" in api  # mkdocstrings rendered the docstrings


@pytest.mark.xdist_group("docs_site")
def test_the_site_fetches_nothing_from_another_host(site):
    """No fonts, scripts, styles or analytics from a CDN: the site reads offline."""
    remote = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""", re.IGNORECASE)
    for page in glob.glob(os.path.join(site, "**", "*.html"), recursive=True):
        text = open(page).read()
        found = [m.group(0) for m in remote.finditer(text)]
        assert not found, (page, found[:3])
        assert "fonts.googleapis" not in text and "googletagmanager" not in text, page


def test_the_readme_is_short_and_its_links_resolve():
    text = open(os.path.join(REPO, "README.md")).read()
    assert len(text.splitlines()) <= 200
    assert text.startswith("```bash\nmake demo ") and "\nmake test " in text.split("```")[1]
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert os.path.exists(os.path.join(REPO, target)), target


HTML_TAGS = {"a", "br", "details", "summary", "div", "span", "img", "p", "sup", "sub", "code", "em", "strong"}


def prose(path: str) -> list[tuple[int, str]]:
    """(line number, line) of a markdown file outside its fenced blocks."""
    lines, inside = [], False
    for number, line in enumerate(open(os.path.join(REPO, path)).read().split("\n"), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            lines.append((number, line))
    return lines


@pytest.mark.parametrize("path", [*doc_files(), "bench/RESULTS.md"])
def test_the_markdown_reads_the_same_on_the_site(path):
    """What GitHub forgives and Python-Markdown (the site) does not: a list right under a paragraph (it runs into
    the paragraph), a `<placeholder>` outside a code span (it vanishes as an unknown HTML tag)."""
    lines = prose(path)
    for (_, before), (number, line) in zip(lines, lines[1:]):
        list_item = re.compile(r"^\s*([-*]|\d+\.) ")
        if list_item.match(line) and before.strip() and not list_item.match(before) and not before.startswith((" ", "<!--")):
            raise AssertionError(f"{path}:{number}: a list needs a blank line above it")
    # code spans, of any number of backticks, may span lines
    text = re.sub(r"(?<!`)(`+)(?!`)[\s\S]*?(?<!`)\1(?!`)", "", "\n".join(line for _, line in lines))
    for match in re.finditer(r"<(/?)([A-Za-z_][\w.-]*)[^>\n]*>", text):
        assert match.group(2).lower() in HTML_TAGS, f"{path}: {match.group(0)} outside a code span"


# ---- every block is tested --------------------------------------------------------------------------


def test_every_block_is_one_the_tests_know():
    """A language this file checks, known markers, and a checker for every block that is neither code nor config."""
    for block in all_blocks():
        assert block.lang in LANGUAGES, f"{block.where}: a code block needs one of {sorted(LANGUAGES)}"
        for marker in block.markers:
            assert marker.partition(":")[0].strip() in MARKERS, f"{block.where}: unknown marker <!-- {marker} -->"
        if block.marker("test") is not None:
            assert block.marker("test") in RUN_BY, f"{block.where}: no test runs <!-- test: {block.marker('test')} -->"
        if block.lang == "text":
            assert block.marker("output") in OUTPUTS or block.marker("test") in RUN_BY, \
                f"{block.where}: a text block needs <!-- output: NAME --> with a checker in test_docs.py"
        if block.lang == "jsonc":
            assert block.marker("rows") is not None, f"{block.where}: JSON blocks are data rows (<!-- rows -->)"
    for name, test in RUN_BY.items():
        assert blocks_marked("test", name), f"no block marked <!-- test: {name} --> ({test} runs it)"
        assert f'"{name}"' in open(os.path.join(REPO, "tests", test)).read(), (name, test)


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.lang == "python"], ids=lambda b: b.where)
def test_python_blocks_compile(block):
    compile(block.text, block.where, "exec")


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.lang == "yaml"], ids=lambda b: b.where)
def test_yaml_blocks_load_through_the_config_loader(block, tmp_path, monkeypatch):
    command = block.marker("config")
    assert command in COMMANDS, f"{block.where}: a YAML block says which command reads it: <!-- config: ppo -->"
    path = tmp_path / "config.yaml"
    path.write_text(block.text)
    monkeypatch.chdir(REPO)
    load_config([f"config={path}"], command)


ROW_KINDS = {"RL": ("rl", Columns()), "SFT": ("sft", Columns()), "RM, DPO": ("pair", Columns()),
             "SFT, images": ("sft", Columns(image_key="images")),
             "RL, data.apply_chat_template=false": ("rl", Columns(apply_chat_template=False))}


@pytest.mark.parametrize("block", blocks_marked("rows"), ids=lambda b: b.where)
def test_data_rows_pass_the_data_checks(block):
    """Each row (`{...}   // KIND`) is valid data of its kind."""
    for line in block.text.strip().splitlines():
        row, _, kind = line.partition("//")
        data_kind, columns = ROW_KINDS[kind.strip()]
        validate_rows(datasets.Dataset.from_list([json.loads(row)]), data_kind, block.where, columns)


class Parsed(Exception):
    """Raised by the patched `ArgumentParser.parse_args` once the arguments parsed: the command does not run."""


def parse_with_argparse(module: str, args: list[str], monkeypatch) -> None:
    """Parse `python -m module ARGS` with the module's own argparse parser, without running it."""
    original = ArgumentParser.parse_args

    def parse_only(parser, args=None, namespace=None):
        original(parser, args, namespace)
        raise Parsed

    monkeypatch.setattr(ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", [module, *args])
    main = importlib.import_module(module).main  # not its `__main__` block: that may re-exec the process
    with pytest.raises(Parsed):
        main(args) if inspect.signature(main).parameters else main()


def created_by_blocks(block) -> set[str]:
    """The files the Python blocks of `block`'s page name in their first line (`# make_data.py: ...`)."""
    names = set()
    for other in all_blocks():
        if other.path == block.path and other.lang == "python":
            match = re.match(r"# ([\w.]+\.py)\b", other.text)
            names |= {match.group(1)} if match else set()
    return names


def extras() -> set[str]:
    setup = open(os.path.join(REPO, "setup.py")).read()
    return set(re.findall(r'^\s+"([\w-]+)": \[', setup[setup.index("extras_require"):], re.MULTILINE))


@pytest.mark.parametrize("line", command_lines(), ids=lambda line: f"{line.block.where}:{line.text[:40]}")
def test_every_bash_line_is_checked(line, monkeypatch):
    """Each command line is parsed by what it calls, names files that exist, or is run by a test."""
    words = line.command
    module = python_module(words)
    if module in RL2_MODULES or (words[0] in ("torchrun", "rl2run") and module is None):
        return  # parsed under its command by test_readme_commands.py
    if module in ARGPARSE_MODULES:
        parse_with_argparse(module, words[words.index(module) + 1:], monkeypatch)
    elif words[0] == "make":
        return  # the target exists: test_readme_commands.py
    elif words[0] == "bash":
        assert os.path.isfile(os.path.join(REPO, words[1])), line.text
    elif words[0] == "python" and module is None:
        assert os.path.isfile(os.path.join(REPO, words[1])) or words[1] in created_by_blocks(line.block), line.text
    elif words[:2] == ["pip", "install"]:
        for spec in words[2:]:
            for extra in re.findall(r"\.\[([\w,-]+)\]", spec):
                assert set(extra.split(",")) <= extras(), (line.text, extras())
    elif words[0] == "export":
        assert re.match(r"^[A-Z_]+=", words[1]), line.text
    elif words[0] == "curl":
        return  # run against a code service: test_readme_commands.py
    else:
        raise AssertionError(f"{line.block.where}: a command the docs tests do not check: {line.text!r}")


# ---- the blocks run here ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> str:
    """The README's quickstart run in an empty folder: its Python blocks saved as the files they name, its
    commands run (torchrun with the suite's forked ranks, 2 steps); the run's folder."""
    folder = tmp_path_factory.mktemp("quickstart")
    readme = [b for b in blocks_marked("test", "quickstart") if b.path == "README.md"]
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
    for block in readme:
        if block.lang == "python":
            (folder / re.match(r"# ([\w.]+\.py)", block.text).group(1)).write_text(block.text)
    for line in command_lines([b for b in readme if b.lang == "bash"]):
        words = line.command
        if words[0] == "torchrun":
            args = words[words.index("-m"):] + ["trainer.total_steps=2", "trainer.test_freq=null"]
            run_torchrun(args, nproc=2, timeout=600, cwd=str(folder))
        else:  # `python ...`: one process, forked from the suite's preloaded modules as the ranks are
            result = forked_or_real(
                lambda: rank_launcher.launch(words[1:], 1, env, str(folder), 300, distributed=False),
                lambda: subprocess.run([sys.executable, *words[1:]], cwd=folder, env=env, capture_output=True,
                                       text=True, timeout=300))
            assert result.returncode == 0, result.stderr[-3000:]
    return str(folder / "ckpts" / "quickstart")


@pytest.mark.xdist_group("docs_quickstart")
def test_the_quickstart_runs_as_written(quickstart_run):
    """It trains, writes its report, and every metric it logs is on the metrics page; the getting-started page
    shows the same blocks as the README."""
    readme = [b.text for b in blocks_marked("test", "quickstart") if b.path == "README.md"]
    others = [b.text for b in blocks_marked("test", "quickstart") if b.path != "README.md"]
    assert others == readme and len(readme) == 3
    rows = read_metrics(os.path.join(quickstart_run, "metrics.jsonl"))
    assert [row["step"] for row in rows] == [1, 2]
    assert os.path.isfile(os.path.join(quickstart_run, "report.html"))
    assert_metrics_documented(rows)


@pytest.mark.xdist_group("docs_quickstart")
def test_the_docs_screenshots_script_shoots_a_report(quickstart_run, tmp_path):
    """docs/screenshots.py (make docs-screenshots) on a real run: both pictures taken; the docs show its pictures."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("no Chromium (apt-get install chromium): the screenshots cannot be taken")
    spec = importlib.util.spec_from_file_location("screenshots", os.path.join(REPO, "docs", "screenshots.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for shot in module.take_screenshots(quickstart_run, str(tmp_path), chromium):
        with open(shot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(shot) > 10_000, shot
    for name in ("report.png", "trajectory.png"):
        assert os.path.isfile(os.path.join(REPO, "docs", "images", name)), name


def test_the_sandbox_example_prints_what_it_shows():
    [block] = blocks_marked("test", "sandbox")
    shown = re.search(r"# (RunResult\(.*)\.\.\.\)", block.text).group(1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block.text, block.where, "exec"), {})
    for field in shown.split(", "):
        if field and not field.startswith("wall_time"):
            assert field.rstrip(",") in printed.getvalue(), (field, printed.getvalue())


def test_the_tool_call_shown_parses_as_the_call_it_is():
    from rl2.chat.tool_parsers import get_tool_parser

    [block] = blocks_marked("test", "hermes-call")
    parsed = get_tool_parser("hermes").parse(block.text)
    [call] = parsed.calls
    assert call.name == "python" and call.error is None, call
    assert call.arguments == {"code": "print(sum(i*i for i in range(11)))"}


def test_the_rl2_key_notes_shown_are_what_rl2_prints(capsys):
    [block] = blocks_marked("output", "rl2-notes")
    load_config(["rollout.train.path=x.jsonl", "trainer.use_wandb=false", "rollout.test.prompts_per_rollout=32"], "ppo")
    printed = capsys.readouterr().err.splitlines()
    for shown in block.text.strip().splitlines():
        prefix = shown.removesuffix("...").rstrip()
        assert any(line.startswith(prefix) for line in printed), (shown, printed)


def test_the_layout_names_files_that_exist():
    [block] = blocks_marked("output", "layout")
    for line in block.text.splitlines():
        path = line.split()[0] if line and not line.startswith(" ") else None
        if path:
            assert os.path.exists(os.path.join(REPO, path)), path


def test_the_step_diagram_names_the_stages_train_step_calls_in_order():
    """docs/development.md's diagram of a PPO step: each name on its left is a stage of rl2.trainer.ppo_stages or a
    method of the Rollout interface, called by `train_step` in that order."""
    import inspect
    import re

    from rl2.rollout.interface import Rollout
    from rl2.trainer import ppo_stages
    from rl2.trainer.ppo import PPOTrainer

    [block] = blocks_marked("output", "ppo-step")
    names = [match.group(1) for line in block.text.splitlines()
             if (match := re.match(r"  (?:Rollout\.)?([a-z_]+)\b", line))]  # a stage: two spaces in
    assert len(names) >= 7, names
    source, position = inspect.getsource(PPOTrainer.train_step), 0
    for name in names:  # each called after the one before it
        assert hasattr(ppo_stages, name) or hasattr(Rollout, name), name
        call = rf"self\.rollout\.{name}\(" if hasattr(Rollout, name) else rf"(?<![.\w]){name}\("
        found = re.compile(call).search(source, position)
        assert found, f"train_step calls no {name} after the stages before it in the diagram"
        position = found.end()


# ---- the generated reference ----------------------------------------------------------------------


def test_the_config_reference_has_every_key_its_default_and_readers():
    hook = load_hook()
    page = hook.config_reference()
    for entry in config_entries(Config):
        if entry.is_section:
            assert re.search(rf"^#+ {re.escape(entry.name)}$", page, re.MULTILINE), entry.name
            continue
        [row] = [line for line in page.splitlines() if f"`{entry.name}`<br>" in line]
        assert f"`{entry.default_text.replace('|', chr(92) + '|')}`" in row and f"`{entry.type_name}`" in row, row
        readers = [name for name, command in COMMANDS.items() if command.reads_key(entry.name)]
        assert row.rstrip(" |").endswith(", ".join(readers) or "none"), (row, readers)
    # --help prints the same entries: every key a command's --help lists is on the page.
    for name in COMMANDS:
        for key in re.findall(r"^  ([\w.]+): ", config_help(command=name), re.MULTILINE):
            assert f"`{key}`<br>" in page, (name, key)


def test_the_rl2_keys_page_has_every_rl2_key():
    page = load_hook().rl2_keys_reference()
    for key in RL2_KEYS:
        assert f"| `{key.name}` |" in page, key.name


# ---- the metrics page -------------------------------------------------------------------------------

# Where the trainers name their metrics: every string literal there that looks like a metric name.
METRIC_SOURCES = ["rl2/trainer/ppo.py", "rl2/trainer/ppo_stages.py", "rl2/trainer/offline.py", "rl2/trainer/dpo.py", "rl2/trainer/rm.py",
                  "rl2/rollout/rollout_metrics.py", "rl2/rollout/partial.py", "rl2/rollout/remote.py",
                  "rl2/rollout/service.py", "rl2/algorithms/off_policy.py", "rl2/algorithms/preference.py",
                  "rl2/rollout/agent_partial.py", "rl2/workers/base.py"]


def metric_literals() -> set[str]:
    """Metric names the code writes: the keys of dicts and of `name[...] =` in METRIC_SOURCES (f-strings with their
    fields as `<x>`), and the phases of `timer("phase")` as `time/phase`."""
    names = set()

    def text(node) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "<x>" for v in node.values)
        return None

    for path in METRIC_SOURCES:
        tree = ast.parse(open(os.path.join(REPO, path)).read())
        for node in ast.walk(tree):
            keys = []
            if isinstance(node, ast.Dict):
                keys = node.keys
            elif isinstance(node, ast.DictComp):
                keys = [node.key]
            elif isinstance(node, ast.Assign):
                targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
                keys = [t.slice for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "timer"
                  and node.args and text(node.args[0])):
                names.add(f"time/{text(node.args[0])}")  # a phase of PhaseTimer: logged as time/<phase>
            for key in keys:
                name = text(key) if key is not None else None
                if name and re.fullmatch(r"[a-z_@<>]+(/[a-z0-9_@<>.]+)*", name) and ("/" in name or name in KNOWN_PLAIN):
                    names.add(name)
    return names


# The metrics without a `/` (`loss`, `kl`, ...) among the dict keys of those files (the others are not metrics).
KNOWN_PLAIN = {"loss", "kl", "kl_loss", "clip_ratio", "entropy", "lr", "grad_norm", "loss_tokens", "truncated",
               "step_time", "tokens_per_second", "reward_errors", "truncated_ratio", "env_errors", "excluded",
               "trajectories", "accuracy", "margin", "pairs"}
# Names the update prefixes with `actor/` or `critic/`, the offline trainers' evaluation with `test/`; of them
# the ones only ever logged with a prefix; and the f-strings that only add a prefix to names found elsewhere.
PREFIXED = {"loss", "clip_ratio", "entropy", "kl_loss", "distill_loss", "moe_aux_loss", "lr", "grad_norm", "loss_tokens"}
ONLY_PREFIXED = {"clip_ratio", "entropy", "kl_loss", "distill_loss", "moe_aux_loss", "logp_mismatch"}
PREFIX_ONLY = {"<x>/<x>", "time/<x>", "test/<x>"}


def test_every_documented_metric_is_one_the_code_logs():
    """Against a stale page: each name on it (its `<parts>` any text) is written by the code."""
    literals = metric_literals()
    logged = literals | {f"{model}/{name}" for model in ("actor", "critic") for name in PREFIXED} | {
        f"test/{name}" for name in literals if not name.startswith(("test/", "time/"))}
    concrete = {re.sub(r"<[^>]+>", "x", name) for name in logged}
    for name in documented_metrics():
        pattern = metric_pattern(name)
        assert any(pattern.match(candidate) for candidate in concrete), name


def test_every_metric_the_code_writes_is_documented():
    """Against an incomplete page: each metric name literal of the code (f-string fields as any text) is on it."""
    plain = {name for name in metric_literals() if "<" not in name} - ONLY_PREFIXED
    assert not undocumented_metrics(plain), undocumented_metrics(plain)
    patterned = {name for name in metric_literals() if "<" in name} - PREFIX_ONLY
    documented = documented_metrics()
    for name in patterned:
        example = name.replace("<x>", "k")
        assert not undocumented_metrics({example}, documented), name


def test_the_metric_check_catches_a_missing_name():
    assert undocumented_metrics({"reward/mean", "tools/search/calls", "test/avg@4", "test/gsm8k/hard/reward_mean"}) == []
    assert undocumented_metrics({"reward/median", "tools/search/calls/x"}) == ["reward/median", "tools/search/calls/x"]
    with pytest.raises(AssertionError, match="reward/median"):
        assert_metrics_documented([{"step": 1, "reward/median": 0.0}])


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_built_site_is_not_committed():
    assert "site/" in open(os.path.join(REPO, ".gitignore")).read().split()
