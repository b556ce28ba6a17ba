"""Metrics to `<save_dir>/metrics.jsonl` (always) and to wandb (online, offline or disabled), on rank 0; and the
summary a PPO run logs at its end, read back from metrics.jsonl (`run_summary`)."""

import contextlib
import json
import logging
import netrc
import os
import time

logger = logging.getLogger(__name__)


def wandb_mode(disable_wandb: bool) -> str:
    """`disabled` when asked; the user's WANDB_MODE if set; `offline` when no account is configured."""
    if disable_wandb:
        return "disabled"
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "offline"


class MetricsLogger:
    """Writes one JSON object per step (`step` plus every metric) and mirrors it to wandb and, with
    `tensorboard`, to TensorBoard event files in `<save_dir>/tensorboard` (same names, same steps); at
    `finish`, the run's HTML report.

    Only rank 0 writes; on other ranks every method is a no-op. Resuming from step N first drops
    lines for steps after N that an interrupted run wrote after its last checkpoint, so the file
    never holds a step twice.
    """

    def __init__(
        self,
        save_dir: str,
        project: str,
        experiment_name: str,
        config: dict,
        disable_wandb: bool,
        enabled: bool,
        resume_step: int = 0,
        tensorboard: bool = False,
    ):
        self.enabled = enabled
        self.run = self.tensorboard = None
        self.save_dir = save_dir
        if not enabled:
            return
        os.makedirs(save_dir, exist_ok=True)
        self.path = os.path.join(save_dir, "metrics.jsonl")
        self._truncate_after(resume_step)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError(f"trainer.tensorboard=true needs the tensorboard package: pip install tensorboard "
                                  f"({error})") from error
            # purge_step: a resumed run first hides the events an interrupted run wrote after its checkpoint.
            self.tensorboard = SummaryWriter(os.path.join(save_dir, "tensorboard"),
                                             purge_step=resume_step + 1 if resume_step else None)
        mode = wandb_mode(disable_wandb)
        if mode != "disabled":
            import wandb  # slow to import; only when used

            if mode == "offline" and not os.environ.get("WANDB_MODE"):
                logger.info("no wandb account configured: logging to wandb offline (sync later with `wandb sync`)")
            self.run = wandb.init(
                project=project, name=experiment_name, config=config, dir=save_dir, mode=mode, resume="allow"
            )

    def _truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = [line for line in f if line.strip()]
        kept = [line for line in lines if json.loads(line)["step"] <= step]
        if len(kept) != len(lines):
            logger.info(f"dropping {len(lines) - len(kept)} metric lines after step {step} from {self.path}")
        with open(self.path, "w") as f:
            f.writelines(kept)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)
        if self.tensorboard is not None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()

    def finish(self) -> None:
        """Close the sinks (the run's report is written after: `rl2.report`)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def read_metrics(path: str) -> list[dict]:
    """The JSON objects of a metrics.jsonl file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class PhaseTimer:
    """Wall-clock seconds per named phase of a step: `with timer("rollout"): ...`, then `timer.times`."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[phase] = self.times.get(phase, 0.0) + time.perf_counter() - start


def curve_summary(rows: list[dict], key: str, buckets: int = 10) -> str:
    """A few lines showing how `key` moved over the steps of `rows` (mean per bucket of steps,
    with a bar for values in [0, 1])."""
    points = [(row["step"], row[key]) for row in rows if key in row]
    if not points:
        return f"{key}: no values"
    size = max(1, -(-len(points) // buckets))
    lines = [f"{key} by step:"]
    for start in range(0, len(points), size):
        chunk = points[start : start + size]
        mean = sum(value for _, value in chunk) / len(chunk)
        first, last = chunk[0][0], chunk[-1][0]
        span = f"{first}" if first == last else f"{first}-{last}"
        lines.append(f"  steps {span:>9}  {mean:7.3f}  {'#' * round(min(max(mean, 0.0), 1.0) * 40)}")
    return "\n".join(lines)


def run_summary(rows: list[dict]) -> str:
    """The reward curve, test results and where the time of a step went, from metrics.jsonl rows."""
    lines = [curve_summary([row for row in rows if row["step"] > 0], "reward/mean")]
    tests = [row for row in rows if "test/reward_errors" in row or "test/reward_mean" in row]
    if tests:
        lines.append("test reward: " + ", ".join(
            f"step {row['step']}: {row['test/reward_mean']:.3f}" if "test/reward_mean" in row
            else f"step {row['step']}: none ({row['test/reward_errors']:.0f} reward_fn errors)" for row in tests
        ))
    lines.append(env_error_summary(rows))
    lines.append(step_time_summary(rows))
    return "\n".join(lines)


def step_time_summary(rows: list[dict]) -> str:
    """Where the time of an updating step went, over the steps that updated (a step with no trajectory left
    to train on logs no `time/step`), and how many did not."""
    phases = ["rollout", "reward", "logps", "update", "sync"]
    ran = [row for row in rows if row["step"] > 0 and any(key.startswith("time/") for key in row)]
    steps = [row for row in ran if "time/step" in row]
    if not steps:
        return (f"no step updated the policy (none of the {len(ran)} steps had a trajectory left to train on: "
                "equal rewards in every group, see dynamic_filter/dropped_ratio, or env errors)")
    means = {p: sum(row.get(f"time/{p}", 0.0) for row in steps) / len(steps) for p in phases}
    step_time = sum(row["time/step"] for row in steps) / len(steps)
    return (f"mean step time {step_time:.3f}s"
            + (f" (of the {len(steps)} of {len(ran)} steps that updated)" if len(steps) < len(ran) else "")
            + ": " + ", ".join(f"{p} {means[p]:.3f}s ({100 * means[p] / max(step_time, 1e-9):.0f}%)" for p in phases))


def env_error_summary(rows: list[dict]) -> str:
    """How many env calls failed over a run (training steps and evaluations), and the faults its
    pools recovered from, from metrics.jsonl rows."""
    steps = [row for row in rows if row["step"] > 0 and "env_errors" in row]
    errors = sum(row["env_errors"] for row in steps)
    reward_errors = sum(row.get("reward_errors", 0.0) for row in steps)
    test_errors = sum(row.get("test/env_errors", 0.0) for row in rows)
    faults: dict[str, float] = {}
    for row in steps:
        for key, value in row.items():
            if key.startswith("faults/") and value:
                faults[key[len("faults/"):]] = faults.get(key[len("faults/"):], 0.0) + value
    line = (f"env errors: {errors:.0f} in {sum(row['env_errors'] > 0 for row in steps)} of {len(steps)} steps "
            f"({reward_errors:.0f} trajectories left unscored), {test_errors:.0f} in evaluations")
    recycled = faults.pop("env_worker_recycles", 0.0)  # planned (rollout.env_worker_max_calls), not a fault
    if faults:
        line += "; recovered faults: " + ", ".join(f"{name} {count:.0f}" for name, count in sorted(faults.items()))
    if recycled:
        line += f"; env workers recycled {recycled:.0f} times (rollout.env_worker_max_calls)"
    return line
