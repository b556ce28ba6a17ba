"""The README's and the docs' code blocks and command lines, and the metric names the metrics page documents:
what tests/test_docs.py, test_readme_commands.py, test_readme_notebook.py and test_rl2_scripts.py read.

A block may be preceded by HTML comments that say how it is tested (`<!-- gpu -->`: it needs a GPU, so it is only
parsed; `<!-- test: NAME -->`: the test NAME runs it; `<!-- config: COMMAND -->`: a YAML file for COMMAND;
`<!-- rows -->`: data rows; `<!-- output: NAME -->`: what a command prints, checked by NAME).
"""

import glob
import os
import re
import shlex
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS_PAGE = os.path.join(REPO, "docs", "reference", "metrics.md")

_FENCE = re.compile(r"^(\s*)(`{3,})(\w*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its file (relative to the repo), first line, language, text and markers."""

    path: str
    line: int
    lang: str
    text: str
    markers: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def marker(self, kind: str) -> str | None:
        """The value of the `<!-- kind: value -->` marker (`""` for a bare `<!-- kind -->`), else None."""
        for marker in self.markers:
            name, _, value = marker.partition(":")
            if name.strip() == kind:
                return value.strip()
        return None


def doc_files() -> list[str]:
    """README.md and every page under docs/, relative to the repo."""
    pages = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
    return ["README.md", *pages]


def blocks_of(path: str) -> list[Block]:
    """The fenced code blocks of one file (indented ones, in list items, are dedented)."""
    lines = open(os.path.join(REPO, path)).read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = match.groups()
        markers, j = [], i - 1
        while j >= 0 and _MARKER.match(lines[j]):
            markers.insert(0, _MARKER.match(lines[j]).group(1))
            j -= 1
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end]]
        blocks.append(Block(path, i + 1, lang, "\n".join(body) + "\n", tuple(markers)))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in blocks_of(path)]


def blocks_marked(kind: str, value: str | None = None) -> list[Block]:
    """The blocks with the marker `kind` (and, given, that value), in file order."""
    return [b for b in all_blocks() if b.marker(kind) is not None and (value is None or b.marker(kind) == value)]


@dataclass(frozen=True)
class CommandLine:
    """One command of a bash block: continuation lines joined, comment dropped."""

    block: Block
    text: str

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def command(self) -> list[str]:
        """The words after leading `NAME=value` environment assignments."""
        words = self.words
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]
        return words


def command_lines(blocks: list[Block] | None = None) -> list[CommandLine]:
    """Every command of the bash blocks (of the README and the docs by default)."""
    lines = []
    for block in blocks if blocks is not None else all_blocks():
        if block.lang != "bash":
            continue
        for line in block.text.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                lines.append(CommandLine(block, line))
    return lines


def python_module(words: list[str]) -> str | None:
    """The module a `python -m M` / `torchrun ... -m M` / `rl2run ... -m M` command runs."""
    return words[words.index("-m") + 1] if "-m" in words[:-1] else None


def key_values(words: list[str], after: str | None) -> list[str]:
    """The `key=value` arguments after the word `after` (all of them without one)."""
    start = words.index(after) + 1 if after in words else 0
    return [word for word in words[start:] if "=" in word and not word.startswith("-")]


# ---- the metrics page ---------------------------------------------------------------------------


def documented_metrics() -> list[str]:
    """The metric names in the first column of the metrics page's tables (`<name>` marks a varying part)."""
    names = []
    for line in open(METRICS_PAGE).read().splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split(" | ")[0]
        names += re.findall(r"`([^`]+)`", first)
    return names


def metric_pattern(name: str) -> re.Pattern:
    """A documented name as a regular expression: each `<part>` matches one or more characters (no `/`
    in `<name>`-style parts of a path, except `<data_source>`, which may hold any)."""
    pattern = ""
    for piece in re.split(r"(<[^>]+>)", name):
        if piece.startswith("<"):
            pattern += ".+" if piece == "<data_source>" else "[^/]+"
        else:
            pattern += re.escape(piece)
    return re.compile(pattern + r"\Z")


def undocumented_metrics(names, documented: list[str] | None = None) -> list[str]:
    """The names (logged metrics, or `step`) that no documented name matches."""
    patterns = [metric_pattern(name) for name in (documented or documented_metrics())]
    return sorted(name for name in set(names) - {"step"} if not any(p.match(name) for p in patterns))


def assert_metrics_documented(rows: list[dict]) -> None:
    """Every metric in `rows` (of a metrics.jsonl) is on docs/reference/metrics.md."""
    missing = undocumented_metrics({name for row in rows for name in row})
    assert not missing, f"metrics logged but not documented in docs/reference/metrics.md: {missing}"
