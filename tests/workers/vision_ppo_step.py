"""One PPO/GRPO step of a vision-language actor on a fixed batch of trajectories with images: the stages of
`PPOTrainer.train_step` between its rollout and its weight sync (`sequences_of`, `compute_logps`,
`add_advantages`, `update`), run on a `Policy` (and a reference with kl.coef > 0, a teacher with
distill.coef > 0, a critic with adv.estimator=gae) as the trainer builds them; rank 0 saves what an independent
reference needs to check it. (The trainer itself needs an
engine that generates with images, which is another part of issue 68.)

Usage: vision_ppo_step.py MODEL_DIR BATCH_FILE OUT_FILE [key=value ...]
BATCH_FILE: torch.save'd list of dicts with the fields of `Trajectory` (token_ids, action_mask, logprobs,
reward, group) and `images` ({"pixel_values", "image_grid_thw"} or None).
Saved: the full state dicts before and after, the gradients of the optimizer step, the sequences' old, reference
and teacher log-probs, the step's metrics; with a critic its state dict before the step, the sequences' old values,
and their values after the step from the critic and from the critic saved as a Hugging Face folder
(OUT_FILE.critic) and loaded again.
"""

import dataclasses
import sys

import torch

from rl2.algorithms.sequences import computed_per_turn
from rl2.checkpoint import save_hf_model
from rl2.config import LoraConfig, load_config
from rl2.distributed.fsdp import gather_full_state_dict
from rl2.distributed.process_group import barrier, exit_process, init_distributed, is_rank0
from rl2.lora import AdaptersOff
from rl2.rollout.trajectory import Trajectory
from rl2.trainer.ppo_stages import StepModels, add_advantages, compute_logps, sequences_of, update
from rl2.trainer.step_plan import StepPlan
from rl2.vision.image_inputs import ImageInputs
from rl2.workers.critic import Critic
from rl2.workers.policy import Policy


def main() -> None:
    model_dir, batch_file, out_file, *overrides = sys.argv[1:]
    init_distributed()
    config = load_config([f"actor.model_name={model_dir}", "actor.dtype=float32", "actor.gradient_checkpointing=false",
                          "critic.dtype=float32", "critic.gradient_checkpointing=false", "trainer.disable_wandb=true",
                          *overrides], "ppo")
    plan = StepPlan.from_config(config, train_max_new_tokens=16)
    actor = Policy(config.actor, 1)
    reference = teacher = None
    if plan.kl is not None and config.actor.lora.rank > 0:
        reference = AdaptersOff(actor)
    elif plan.kl is not None:
        reference = Policy(dataclasses.replace(config.actor, offload_model=False), 0, trainable=False)
    if plan.distill is not None:  # as PPOTrainer builds it
        teacher = Policy(dataclasses.replace(config.actor, model_name=config.teacher.model_name,
                                             tokenizer_name=config.teacher.model_name, lora=LoraConfig()),
                         0, trainable=False)
    critic = None
    if plan.critic is not None:  # as PPOTrainer builds it
        critic_config = dataclasses.replace(config.critic, model_name=config.critic.model_name or model_dir)
        critic = Critic(critic_config, 1)
        critic_before = {k: v.clone() for k, v in gather_full_state_dict(critic.model).items()}
    trajectories = []
    for fields in torch.load(batch_file, weights_only=False):
        images = fields.pop("images")
        trajectories.append(Trajectory(messages=[], answer=None, images=images and ImageInputs(**images), **fields))
    before = {k: v.clone() for k, v in gather_full_state_dict(actor.model).items()}
    grads: dict[str, torch.Tensor] = {}

    def capture(*_) -> None:  # the gradients the optimizer steps with (after clipping), in full
        for name, p in actor.model.named_parameters():
            if p.grad is not None:
                grads[name] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()

    actor.optimizer.register_step_pre_hook(capture)
    step = 1
    sequences = sequences_of(trajectories, plan)
    models = StepModels(actor, reference, teacher, critic)
    metrics = {**compute_logps(sequences, plan, models, step), **add_advantages(sequences, trajectories, plan, step)}
    metrics.update(update(sequences, plan, models, step))
    after = gather_full_state_dict(actor.model)
    saved = {}
    if critic is not None:
        saved["critic_before"] = critic_before
        saved["values_after"] = computed_per_turn(critic.compute, sequences, "values")
        save_hf_model(critic.model, f"{out_file}.critic", "float32")
        barrier()
        reloaded = Critic(dataclasses.replace(critic.config, model_name=f"{out_file}.critic"), 1)
        saved["values_reloaded"] = computed_per_turn(reloaded.compute, sequences, "values")
    if is_rank0():
        torch.save({"before": before, "after": after, "grads": grads, "metrics": metrics,
                    "old_logps": [s.get("old_logps") for s in sequences],
                    "ref_logps": [s.get("ref_logps") for s in sequences],
                    "teacher_logps": [s.get("teacher_logps") for s in sequences],
                    "old_values": [s.get("old_values") for s in sequences], **saved}, out_file)


if __name__ == "__main__":
    main()
    exit_process(0)
