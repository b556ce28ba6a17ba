"""One run per checkpoint folder: a training run records itself in `<save_dir>/run.json` and refuses a
folder that holds another run's checkpoints or metrics, unless it resumes that run or overwrites it.

What counts as another run's output: `step<N>/` checkpoint folders, `metrics.jsonl` and
`trajectories/step_*.jsonl` (an evaluation-only run writes `eval.json` and `trajectories/eval.jsonl`,
which do not block a training run). The marker alone (a run that stopped before its first step) does not.
"""

import glob
import json
import logging
import os
import re
import shutil
import time

logger = logging.getLogger(__name__)

MARKER = "run.json"


def checkpoint_steps(save_dir: str) -> list[int]:
    """The steps of the `step<N>/` folders under `save_dir` (complete or not), in order."""
    if not os.path.isdir(save_dir):
        return []
    steps = [int(m.group(1)) for name in os.listdir(save_dir) if (m := re.fullmatch(r"step(\d+)", name))]
    return sorted(step for step in steps if os.path.isdir(os.path.join(save_dir, f"step{step}")))


def run_outputs(save_dir: str) -> list[str]:
    """The paths under `save_dir` that a training run wrote: its checkpoints, metrics and step trajectories."""
    paths = [os.path.join(save_dir, f"step{step}") for step in checkpoint_steps(save_dir)]
    if os.path.isfile(os.path.join(save_dir, "metrics.jsonl")):
        paths.append(os.path.join(save_dir, "metrics.jsonl"))
    return paths + sorted(glob.glob(os.path.join(save_dir, "trajectories", "step_*.jsonl")))


def read_marker(save_dir: str) -> dict | None:
    """The run marker of `save_dir`, or None when there is none (or it cannot be read)."""
    try:
        with open(os.path.join(save_dir, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def write_marker(save_dir: str, command: str, experiment_name: str) -> None:
    """Record the run that starts in `save_dir`: its command, experiment name and start time."""
    os.makedirs(save_dir, exist_ok=True)
    marker = {"command": command, "experiment_name": experiment_name, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(os.path.join(save_dir, MARKER), "w") as f:
        json.dump(marker, f)


def describe_run(save_dir: str) -> str | None:
    """What run's outputs `save_dir` holds, in words (e.g. "the sft run 'run' started 2026-01-02
    10:00:00, checkpoints step1, step2, metrics.jsonl"); None when it holds none."""
    if not run_outputs(save_dir):
        return None
    marker = read_marker(save_dir)
    if marker is None:
        who = "a run without a run marker"
    else:
        who = f"the {marker.get('command', '?')} run '{marker.get('experiment_name', '?')}' started {marker.get('started', '?')}"
    steps = checkpoint_steps(save_dir)
    parts = [f"checkpoints {', '.join(f'step{step}' for step in steps)}" if steps else "no checkpoint"]
    if os.path.isfile(os.path.join(save_dir, "metrics.jsonl")):
        parts.append("metrics.jsonl")
    if glob.glob(os.path.join(save_dir, "trajectories", "step_*.jsonl")):
        parts.append("trajectories/")
    return f"{who} ({', '.join(parts)})"


def clear_run(save_dir: str) -> list[str]:
    """Delete a previous run's `step<N>/` folders, `metrics.jsonl`, `trajectories/`, `tensorboard/`, report and marker from
    `save_dir`; returns what was deleted (other files, e.g. wandb/ or eval.json, stay)."""
    paths = [os.path.join(save_dir, f"step{step}") for step in checkpoint_steps(save_dir)]
    paths += [os.path.join(save_dir, name)
              for name in ("metrics.jsonl", "trajectories", "tensorboard", "report.html", "report_files", MARKER)]
    deleted = []
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        else:
            continue
        deleted.append(os.path.basename(path))
    return deleted


def check_run_folder(save_dir: str, key: str, resume: bool, overwrite: bool) -> str | None:
    """Why a run may not start in `save_dir` (`key` names the setting), or None when it may: the folder
    holds another run's outputs and this run neither resumes (`trainer.load_ckpt_from`) nor overwrites
    (`trainer.overwrite`) it. The message names that run and the ways out. Reads only."""
    previous = describe_run(save_dir)
    if previous is None or resume or overwrite:
        return None
    return (
        f"{key}={save_dir} holds another run: {previous}. To continue it, pass trainer.load_ckpt_from=latest; "
        f"to start over there, trainer.overwrite=true (deletes its checkpoints, metrics.jsonl and trajectories/); "
        f"or give this run its own folder: another trainer.experiment_name (the folder is ckpts/<experiment_name>) "
        f"or {key}"
    )


def claim_run_folder(save_dir: str, command: str, experiment_name: str, resume: bool, overwrite: bool) -> None:
    """Make `save_dir` this run's folder, once `check_run_folder` allowed it and just before the run
    writes there (one process: rank 0). With `overwrite` a previous run's outputs are deleted first
    (logged); a fresh run writes the marker, a resumed one keeps the marker it finds."""
    if overwrite:
        previous = describe_run(save_dir)
        deleted = clear_run(save_dir)
        if deleted:
            logger.warning(f"trainer.overwrite=true: deleted {previous or 'a previous run'} from {save_dir}: "
                           f"{', '.join(deleted)}")
    if not resume or read_marker(save_dir) is None:
        write_marker(save_dir, command, experiment_name)
