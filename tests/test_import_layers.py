"""rl2's packages import each other in one direction: a test over every import in the package (read with `ast`,
imports inside functions included), not over what happens to load.

Nodes are rl2's folders (rl2/rollout, rl2/serve, ...) and its top-level modules (rl2/metrics.py, ...). Two nodes
that import each other are a circle, and there is none (issue 67); a node in `LAYERS` never imports one above
it."""

import ast
import functools
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "rl2")

# Layers that must never import upwards (earlier in the list = lower).
LAYERS = ["errors", "config", "chat", "vision", "data", "engines", "serve", "rollout", "trainer"]


def node_of(module: str) -> str | None:
    """`rl2.rollout.env` -> "rollout"; `rl2.metrics` -> "metrics"; None outside rl2."""
    parts = module.split(".")
    if parts[0] != "rl2" or len(parts) < 2:
        return None
    return parts[1]


@functools.cache  # read once for both tests
def imports() -> dict[str, dict[str, list[str]]]:
    """node -> imported node -> the files that import it."""
    edges: dict[str, dict[str, list[str]]] = {}
    for root, _, names in os.walk(PACKAGE):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            relative = os.path.relpath(path, REPO)
            module = relative[:-3].replace(os.sep, ".").removesuffix(".__init__")
            source = node_of(module)
            if source is None or "compat" in module.split("."):  # RL2's module path: an alias layer of its own
                continue
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [node.module]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    continue
                for target in targets:
                    imported = node_of(target)
                    if imported is not None and imported != source:
                        edges.setdefault(source, {}).setdefault(imported, []).append(relative)
    return edges


def test_no_import_circles_between_folders():
    edges = imports()
    circles = {tuple(sorted((a, b))) for a, targets in edges.items() for b in targets if a in edges.get(b, {})}
    assert not circles, "import circles: " + "; ".join(
        f"{a} -> {b} ({', '.join(sorted(set(edges[a][b])))}) and {b} -> {a} ({', '.join(sorted(set(edges[b][a])))})"
        for a, b in sorted(circles))


def test_layers_never_import_upwards():
    edges = imports()
    upward = [(low, high, sorted(set(edges[low][high])))
              for i, low in enumerate(LAYERS) for high in LAYERS[i + 1:] if high in edges.get(low, {})]
    assert not upward, upward
