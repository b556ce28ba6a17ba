"""`python -m rl2.trainer.ppo --check key=value ...`: a run's config checked without loading a model.

The keys (unknown ones, types, choices, the command's checks in `rl2.config_checks`), the data files (loaded,
their first `FIRST_ROWS` rows validated as the command reads them), the env or agent file (loaded, its functions
checked) and each model and tokenizer the command loads (a local folder, or a Hub name whose config resolves,
from the cache when offline). Each check that passes is one line on stdout; the first that fails raises the
error a run would (`ConfigError`, `DataError`, `EnvError`), which the entry point reports as one
`rl2: error: ...` line, exit code 2.
"""

import os
from collections.abc import Callable

from rl2.config import Config, ConfigError, load_config
from rl2.config.env_interface import rl2_sample_interface
from rl2.config_checks import check_config
from rl2.data.rows import Columns, load_rows, validate_rows

CHECK_FLAG = "--check"
FIRST_ROWS = 100
# The kind of rows each command reads (`rl2.data.rows.validate_rows`).
ROW_KINDS = {"ppo": "rl", "filter": "rl", "search": "rl", "sft": "sft", "rm": "pair", "dpo": "pair"}


def run_check(args: list[str], command: str, say: Callable[[str], None] = print) -> None:
    """Check the run `args` (with `--check` among them) describe for `command`; `say` each check passed."""
    config = load_config([arg for arg in args if arg != CHECK_FLAG], command)
    check_config(config, command)
    say(f"rl2: check: the keys parse and fit together for rl2.{_module(command)}")
    for line in _check_data(config, command):
        say(f"rl2: check: {line}")
    for line in _check_files(config, command):
        say(f"rl2: check: {line}")
    for key, name in _models(config, command):
        say(f"rl2: check: {key}={name}: {_resolve_model(key, name)}")
    say("rl2: check: ok (no model was loaded)")


def _module(command: str) -> str:
    return "search" if command == "search" else f"trainer.{'difficulty_filter' if command == 'filter' else command}"


def _check_data(config: Config, command: str) -> list[str]:
    """Load each data file the run reads and validate its first rows; one line per file."""
    kind = ROW_KINDS[command]
    columns = Columns.for_run(config, kind)
    keys = ["data.test_path"] if config.trainer.eval_only else ["data.path", "data.test_path"]
    lines = []
    for key in keys:
        path = getattr(config.data, key.split(".")[1])
        if path is None:
            continue
        rows = _quietly(load_rows, path)
        first = rows.select(range(min(FIRST_ROWS, len(rows))))
        validate_rows(first, kind, path, columns)
        lines.append(f"{key}={path}: {len(rows)} rows, columns {rows.column_names}; the first {len(first)} are "
                     f"valid {kind} rows")
    return lines


def _quietly(load: Callable, path: str):
    """`load(path)` without `datasets`' progress bars (the check's output is its lines)."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return load(path)
    finally:
        if shown:
            datasets.enable_progress_bars()


def _check_files(config: Config, command: str) -> list[str]:
    """Load the env file (and the agent file) the run uses and check their functions; one line per file."""
    rollout = config.rollout
    if command not in ("ppo", "filter", "search"):
        return []
    lines = []
    if rollout.agent_path:
        from rl2.rollout.agent_rollout import AgentFile

        AgentFile(rollout.agent_path, rollout.env_args)
        lines.append(f"rollout.agent_path={rollout.agent_path}: loads, defines run(row, client)")
    if rollout.env_path:
        lines.append(f"rollout.env_path={rollout.env_path}: {_check_env_file(config)}")
    return lines


def _check_env_file(config: Config) -> str:
    from rl2.rollout.env import Env

    rollout = config.rollout
    if rl2_sample_interface(rollout.env_path):
        from rl2.rollout.rl2_head_rollout import RL2HeadFile

        RL2HeadFile(rollout.env_path, rollout.env_args)
        return "loads, written to RL2 HEAD's interface: its generate(config, tokenizer, router_url, sample) runs it"
    need_interact = rollout.max_turns > 1 and not rollout.agent_path
    with Env.from_config(rollout, need_interact=need_interact, step_discount=config.adv.gamma) as env:
        defined = [name for name, present in (
            ("reward_fn", not env.scores_with_environment), ("interact", env.has_interact),
            ("roc_penalty", env.has_roc_penalty), ("a stateful environment", env.environment_factory is not None),
        ) if present]
        tools = f", tools {', '.join(env.tools)}" if env.tools else ""
    return f"loads, defines {', '.join(defined)}{tools}"


def _models(config: Config, command: str) -> list[tuple[str, str]]:
    """(key, name) of each model and tokenizer `command` loads with `config`."""
    sections = {"ppo": ["actor"], "sft": ["actor"], "dpo": ["actor"], "rm": ["critic"], "filter": ["actor"],
                "search": ["actor"]}[command]
    if command == "ppo" and config.adv.estimator == "gae" and config.critic.model_name:
        sections.append("critic")
    found = []
    for section in sections:
        model = getattr(config, section)
        found.append((f"{section}.model_name", model.model_name))
        if model.tokenizer_name and model.tokenizer_name != model.model_name:
            found.append((f"{section}.tokenizer_name", model.tokenizer_name))
    if command == "ppo" and config.distill.coef > 0:
        found.append(("teacher.model_name", config.teacher.model_name))
    if command == "search" and config.search.ppm_path:
        found.append(("search.ppm_path", config.search.ppm_path))
    return [(key, name) for key, name in found if name]


def _resolve_model(key: str, name: str) -> str:
    """Where the model `name` comes from (its config read, no weights); ConfigError when it cannot be found
    locally nor fetched (a Hub name offline and not in the cache, a misspelled name, a private repo)."""
    from transformers import AutoConfig

    local = os.path.isdir(os.path.expanduser(name))
    try:
        model_config = AutoConfig.from_pretrained(os.path.expanduser(name))
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        where = "a local folder without a model config" if local else "not a local folder, and not fetched from the Hub"
        raise ConfigError(f"{key}={name}: {where}: {reason}") from None
    architecture = ", ".join(model_config.architectures or [model_config.model_type])
    return f"{architecture}, {'a local folder' if local else 'on the Hugging Face Hub (or its cache)'}"
