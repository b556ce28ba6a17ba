"""What the demo benchmarks share (bench/offpolicy.py, bench/async_rollout.py): running an rl2 command with its
output in a log, and the demo's tiny model, data and SFT warm-up (recipes/ppo_tiny.sh's first half)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(args: list[str], log: str) -> None:
    """`python *args` from the repository, its output in `log`; a failure stops the benchmark naming the log."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed ({done.returncode}); see {log}")


def warm_up(out: str, sft_steps: int, task: str, hidden_size: int = 128, layers: int = 2,
            model_args: tuple[str, ...] = (), dtype: str = "float32", lr: float = 3e-3) -> str:
    """The demo's model (or one of another size: `model_args` are more `rl2.testing.tiny` flags), data (`task`:
    successor or lookup) and SFT warm-up (in `dtype` at `lr`) on one process; the warmed-up model."""
    python(["-m", "rl2.testing.tiny", f"{out}/model", "--hidden-size", str(hidden_size), "--layers", str(layers),
            *model_args], f"{out}/tiny.log")
    python(["recipes/make_demo_data.py", "--task", task, "--out", f"{out}/data", "--rows", "4000"], f"{out}/data.log")
    python(["-m", "rl2.trainer.sft", f"data.path={out}/data/sft.jsonl", "data.batch_size=64",
            f"actor.model_name={out}/model", f"actor.dtype={dtype}", "actor.gradient_checkpointing=false", f"actor.lr={lr}",
            "actor.warmup_ratio=0.2", f"actor.save_dir={out}/sft", f"trainer.total_steps={sft_steps}",
            "trainer.disable_wandb=true"], f"{out}/sft.log")
    return f"{out}/sft/step{sft_steps}"
