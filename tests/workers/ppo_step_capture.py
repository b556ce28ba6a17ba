"""One PPO step of the trainer (`train_step`, the rollout replaced by a given batch); rank 0 saves what an
independent reference needs to check it.

Usage: ppo_step_capture.py MODEL_DIR DATA ENV SPEC_JSON OUT_FILE [key=value ...]

SPEC_JSON: {"trajectories": [{"token_ids", "action_mask", "reward", "group"}, ...] in groups of
data.responses_per_prompt, "perturb": std of noise added to the actor's weights after loading (so the
policy differs from the reference model, which keeps MODEL_DIR's weights; one rank only),
"logprob_noise": half-width of uniform noise added to the actor's own log-probs to make the engine's
log-probs of the batch (so the ratio to them is not 1)}.

Trajectories may carry "messages" (GRPO-RoC's penalties read them).

Saved: the actor's and critic's weights before and after the step, the gradients and learning rate of
every optimizer step (after clipping), the engine log-probs used, the step's metrics, the number of the
actor's separate forward passes (`compute`), and with GRPO-RoC the indices of the trajectories it kept.
"""

import copy
import json
import sys

import torch

from rl2.config import load_config
from rl2.distributed.fsdp import gather_full_state_dict
from rl2.distributed.process_group import exit_process, is_rank0, world_size
from rl2.rollout.trajectory import Trajectory
from rl2.trainer import ppo_stages
from rl2.trainer.ppo import PPOTrainer


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().clone()


def capture_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every step of `optimizer`: the gradients it steps with (after clipping) and its learning rate."""
    steps: list[dict] = []

    def capture(*_) -> None:
        steps.append({"grads": {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None},
                      "lr": optimizer.param_groups[0]["lr"]})

    optimizer.register_step_pre_hook(capture)
    return steps


def main() -> None:
    model_dir, data, env, spec_file, out_file, *overrides = sys.argv[1:]
    config = load_config([
        f"actor.model_name={model_dir}", f"data.path={data}", f"rollout.env_path={env}", "actor.dtype=float32",
        "critic.dtype=float32", "actor.gradient_checkpointing=false", "critic.gradient_checkpointing=false",
        "trainer.disable_wandb=true", f"actor.save_dir={out_file}.ckpt", *overrides,
    ])
    trainer = PPOTrainer(config)
    with open(spec_file) as f:
        spec = json.load(f)
    trajectories = [Trajectory(messages=t.get("messages", []), answer=None, logprobs=[0.0] * len(t["token_ids"]),
                               **{k: v for k, v in t.items() if k != "messages"}) for t in spec["trajectories"]]
    actor = trainer.actor.model
    if spec.get("perturb"):
        assert world_size() == 1, "the perturbation is drawn per parameter shard: one rank only"
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in actor.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(spec["perturb"] * torch.randn(local.shape, generator=generator))
    if spec.get("logprob_noise"):
        sequences = [{"input_ids": torch.tensor(t.token_ids), "loss_mask": torch.tensor(t.action_mask, dtype=torch.float32)}
                     for t in trajectories]
        generator = torch.Generator().manual_seed(2)
        for t, logps in zip(trajectories, trainer.actor.compute(sequences, "logps")):
            noise = (2 * torch.rand(len(logps), generator=generator) - 1) * spec["logprob_noise"]
            t.logprobs = ((logps + noise) * torch.tensor(t.action_mask)).tolist()
    steps = {"actor": capture_steps(actor, trainer.actor.optimizer)}
    models = {"actor": actor}
    if trainer.critic is not None:
        steps["critic"] = capture_steps(trainer.critic.model, trainer.critic.optimizer)
        models["critic"] = trainer.critic.model
    before = {name: {k: v.clone() for k, v in gather_full_state_dict(model).items()} for name, model in models.items()}
    generated: list[Trajectory] = []
    trainer.rollout.generate = lambda *args, **kwargs: generated.extend(copy.deepcopy(trajectories)) or generated
    kept: list[int] = []  # GRPO-RoC: the indices of the trajectories it kept
    resample = ppo_stages.resample_on_correct

    def recording_resample(batch: list[Trajectory], *args):
        chosen, roc_metrics = resample(batch, *args)
        kept.extend(next(i for i, t in enumerate(batch) if t is c) for c in chosen)
        return chosen, roc_metrics

    ppo_stages.resample_on_correct = recording_resample  # the step's stages look it up in their module
    compute_calls = []  # the actor's separate forward passes (the proximal pass, unless taken from the update)
    compute = trainer.actor.compute
    trainer.actor.compute = lambda *args, **kwargs: compute_calls.append(1) or compute(*args, **kwargs)
    trainer.step = 1
    metrics = trainer.train_step()
    after = {name: gather_full_state_dict(model) for name, model in models.items()}
    if is_rank0():
        torch.save({"before": before, "after": after, "steps": steps, "metrics": metrics,
                    "logprobs": [t.logprobs for t in trajectories], "kept": kept,
                    "actor_compute_calls": len(compute_calls)}, out_file)
    exit_process(0)


if __name__ == "__main__":
    main()
