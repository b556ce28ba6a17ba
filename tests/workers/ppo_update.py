"""One PPO update from a fixed rollout, then a weight sync; rank 0 saves what the update stepped with.

Usage: ppo_update.py MODEL_DIR DATA ENV OUT_FILE ESTIMATOR [key=value ...]

ESTIMATOR is `grpo` (group-normalised, KL as a k3 loss, DAPO clip), `gae` (critic, KL in the
reward), `gspo-icepop` or `cispo-geo-mis` (those policy losses and corrections, an entropy bonus, the
engine's log-probs the actor's with noise), `dr-grpo`, or `distill-loss` (on-policy distillation as a
loss; give teacher.model_name=...). After the update the engine generates from a few prompts and the largest difference
between its log-probs and the actor's on those tokens is saved as `sync_max_diff`.

The models step with plain SGD instead of AdamW (`use_sgd`): SGD moves a parameter by lr times
its gradient, so gradients that differ by rounding (1 vs 2 ranks, one processor vs another) give
parameters, and next-step gradients, that differ by rounding too. AdamW's first steps are
~lr * sign(g): it turns rounding in a near-zero gradient into a step of up to lr either way, and the
next minibatch's gradients are then taken at visibly different parameters. (The sharded AdamW step
itself is checked against a replay on the same gradients in test_fsdp.py.) Per weight the gradients
are ~1e-3: SGD at lr 1 moves the policy enough that GAE's second minibatch clips some ratios; the
critic's larger gradients take lr 0.1.

Saved per model ("actor", and "critic" when there is one): the parameters before the update and
after it, and the full gradients and lr of every optimizer step (step_capture.py); the metrics.
"""

import sys

import torch

from rl2.config import load_config
from rl2.distributed.process_group import all_gather_objects, exit_process, is_rank0
from rl2.distributed.fsdp import gather_full_state_dict
from rl2.rollout.trajectory import Trajectory
from rl2.trainer.ppo import PPOTrainer
from rl2.trainer.ppo_stages import add_advantages, compute_logps, sequences_of, update
from step_capture import capture_steps, use_sgd

ESTIMATORS = {
    "grpo": ["adv.norm_var=true", "kl.coef=0.1", "kl.type=loss", "kl.loss_estimator=k3", "actor.clip_high=0.28"],
    "gae": ["adv.estimator=gae", "kl.coef=0.1", "kl.type=reward", "critic.lr=0.1", "critic.update_per_rollout=2"],
    # The off-policy losses and corrections: the engine's log-probs are the actor's with noise (see main).
    "gspo-icepop": ["adv.norm_var=true", "actor.policy_loss=gspo", "actor.loss_level=sequence", "actor.gspo_clip=0.05",
                    "actor.gspo_clip_high=0.08", "actor.rollout_correction=icepop", "actor.icepop_low=0.8",
                    "actor.icepop_high=1.25", "actor.entropy_coef=0.01"],
    "cispo-geo-mis": ["adv.norm_var=true", "actor.policy_loss=cispo", "actor.clip_high=0.1",
                      "actor.rollout_correction=geo_mis", "actor.correction_threshold=1.05"],
    # Dr. GRPO: no std division, each sequence's token sum over a constant
    "dr-grpo": ["actor.loss_agg=seq_mean_token_sum_norm", "actor.loss_agg_norm=16"],
    # On-policy distillation as a loss (the teacher: a teacher.model_name=... override)
    "distill-loss": ["adv.norm_var=true", "distill.coef=0.5", "distill.mode=loss"],
}
NOISY_ENGINE = ("gspo-icepop", "cispo-geo-mis")


def fixed_rollout(group_size: int, n_groups: int, seed: int = 0) -> list[Trajectory]:
    """Random trajectories, some with a tool segment (mask 0) between two generated turns."""
    generator = torch.Generator().manual_seed(seed)

    def ints(low, high, n=1):
        return torch.randint(low, high, (n,), generator=generator).tolist()

    trajectories = []
    for group in range(n_groups):
        prompt = ints(3, 1000, ints(3, 12)[0])
        for _ in range(group_size):
            mask = [0] * len(prompt) + [1] * ints(1, 15)[0]
            if ints(0, 2)[0]:
                mask += [0] * ints(1, 6)[0] + [1] * ints(1, 10)[0]
            tokens = prompt + ints(3, 1000, len(mask) - len(prompt))
            trajectories.append(
                Trajectory(
                    messages=[], answer=None, group=group, token_ids=tokens, action_mask=mask,
                    logprobs=[0.0] * len(tokens), reward=float(ints(0, 2)[0]),
                )
            )
    return trajectories


def main() -> None:
    model_dir, data, env, out_file, estimator, *overrides = sys.argv[1:]
    config = load_config(
        [
            f"actor.model_name={model_dir}", f"data.path={data}", f"rollout.env_path={env}",
            "actor.dtype=float32", "critic.dtype=float32", "actor.lr=1.0", "actor.max_grad_norm=1e9",
            "critic.max_grad_norm=1e9", "actor.max_length_per_device=64", "critic.max_length_per_device=64",
            "data.responses_per_prompt=4", "data.prompts_per_rollout=4", "actor.update_per_rollout=2",
            "trainer.disable_wandb=true", f"actor.save_dir={out_file}.ckpt", "actor.gradient_checkpointing=false",
            "rollout.train_sampling_params={temperature: 1.0, max_new_tokens: 8}",
            *ESTIMATORS[estimator], *overrides,
        ]
    )
    trainer = PPOTrainer(config)
    models = {"actor": trainer.actor}
    if trainer.critic is not None:
        models["critic"] = trainer.critic
    # cloned: on one CPU rank the full state dict shares memory with the parameters
    before = {name: {k: v.clone() for k, v in gather_full_state_dict(m.model).items()} for name, m in models.items()}
    for model in models.values():
        use_sgd(model)
    steps = {name: capture_steps(m.model, m.optimizer) for name, m in models.items()}
    rollout = fixed_rollout(group_size=4, n_groups=4)
    if estimator in NOISY_ENGINE:  # behaviour log-probs near the actor's, so the corrections have ratios to work on
        generator = torch.Generator().manual_seed(3)
        actual = trainer.actor.compute([{"input_ids": torch.tensor(t.token_ids),
                                         "loss_mask": torch.tensor(t.action_mask, dtype=torch.float32)} for t in rollout])
        for t, logps in zip(rollout, actual):
            noise = (2 * torch.rand(len(logps), generator=generator) - 1) * 0.3
            t.logprobs = ((logps + noise) * torch.tensor(t.action_mask)).tolist()
    sequences = sequences_of(rollout, trainer.plan)
    prepared = compute_logps(sequences, trainer.plan, trainer.models, step=1)
    prepared.update(add_advantages(sequences, rollout, trainer.plan, step=1))
    updated = update(sequences, trainer.plan, trainer.models, step=1)

    trainer.rollout.sync_weights(trainer.actor.model)
    prompts = [[5, 17, 300 + i, 42] for i in range(3)]
    generations = trainer.rollout.engine.generate(prompts, trainer.rollout.train_params)
    sampled = [
        {
            "input_ids": torch.tensor(p + g.token_ids),
            "loss_mask": torch.tensor([0.0] * len(p) + [1.0] * len(g.token_ids)),
        }
        for p, g in zip(prompts, generations)
    ]
    # Every rank must join the actor's forward; each checks its own engine.
    actor_logps = trainer.actor.compute(all_gather_objects(sampled))
    rank_samples = all_gather_objects([(len(p), g.logprobs) for p, g in zip(prompts, generations)])
    sync_diff = max(
        (actor[n:] - torch.tensor(engine)).abs().max().item()
        for actor, (n, engine) in zip(actor_logps, rank_samples)
    )
    after = {name: gather_full_state_dict(m.model) for name, m in models.items()}
    if is_rank0():
        saved = {name: {"before": before[name], "after": after[name], "steps": steps[name]} for name in models}
        torch.save({**saved, "metrics": {**prepared, **updated}, "sync_max_diff": sync_diff}, out_file)
    exit_process(0)


if __name__ == "__main__":
    main()
