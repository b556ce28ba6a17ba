"""One GRPO update of the PPO trainer on a given batch; rank 0 saves what a reference needs to check it.

Usage: grpo_update_capture.py MODEL_DIR DATA ENV BATCH_JSON OUT_FILE [key=value ...]

BATCH_JSON holds trajectories (`token_ids`, `action_mask`, `reward`, `group`) in
groups of `data.responses_per_prompt`. Saved: the parameters before the step, the gradients the
optimizer stepped with (after clipping), the parameters after it, the lr it used and the metrics.
"""

import json
import sys

import torch

from rl2.config import load_config
from rl2.distributed.process_group import exit_process, is_rank0
from rl2.distributed.fsdp import gather_full_state_dict
from rl2.rollout.trajectory import Trajectory
from rl2.trainer.ppo import PPOTrainer
from rl2.trainer.ppo_stages import add_advantages, compute_logps, sequences_of, update


def main() -> None:
    model_dir, data, env, batch_file, out_file, *overrides = sys.argv[1:]
    config = load_config(
        [
            f"actor.model_name={model_dir}", f"data.path={data}", f"rollout.env_path={env}",
            "actor.dtype=float32", "actor.gradient_checkpointing=false", "trainer.disable_wandb=true",
            f"actor.save_dir={out_file}.ckpt", *overrides,
        ]
    )
    trainer = PPOTrainer(config)
    with open(batch_file) as f:
        trajectories = [Trajectory(messages=[], answer=None, logprobs=[0.0] * len(t["token_ids"]), **t) for t in json.load(f)]
    model, optimizer = trainer.actor.model, trainer.actor.optimizer
    captured = {}

    def capture_gradients(*_) -> None:  # runs inside optimizer.step(), after clipping
        captured["grads"] = {
            name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu().clone()
            for name, p in model.named_parameters()
        }
        captured["lr"] = optimizer.param_groups[0]["lr"]

    optimizer.register_step_pre_hook(capture_gradients)
    # cloned: on one CPU rank the full state dict shares memory with the parameters
    before = {name: tensor.clone() for name, tensor in gather_full_state_dict(model).items()}
    sequences = sequences_of(trajectories, trainer.plan)
    prepared = compute_logps(sequences, trainer.plan, trainer.models, step=1)
    prepared.update(add_advantages(sequences, trajectories, trainer.plan, step=1))
    updated = update(sequences, trainer.plan, trainer.models, step=1)
    after = gather_full_state_dict(model)
    if is_rank0():
        torch.save({"before": before, "after": after, **captured, "metrics": {**prepared, **updated}}, out_file)
    exit_process(0)


if __name__ == "__main__":
    main()
