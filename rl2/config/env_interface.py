"""Which interface an env file is written to, read from its source without running it: the config's
defaults and the columns a run's rows need depend on it (loading the file is `rl2.rollout.env_file`)."""

import ast

# RL2's env interface since Oct 2025 (`async def env_step(sample)`, `generate = partial(base_generate, ...)`).
RL2_SAMPLE_FUNCTIONS = ("env_step", "generate")


def rl2_sample_interface(path: str) -> str | None:
    """What makes an env file one written for RL2's interface since Oct 2025 (`env_step(sample)` /
    `generate`, imports from `RL2`): "defines env_step and generate", "imports RL2"; None for a file of
    rl2's own interface (or one that does not parse: loading reports it, with the line)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    defined, imports_rl2 = set(), False
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "RL2":
            imports_rl2 = True
        elif isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "RL2" for alias in node.names):
            imports_rl2 = True
    newer = [name for name in RL2_SAMPLE_FUNCTIONS if name in defined]
    if "reward_fn" in defined or not (newer or imports_rl2):
        return None
    return f"defines {' and '.join(newer)}" if newer else "imports RL2"
