"""The PPO trainer's wiring: one whole `train_step` (the rollout replaced by a fixed batch) against an
independent reference, for a grid of the settings that change a step's maths.

The reference is written from the algorithms, not from rl2: plain transformers models run one sequence at
a time; the KL estimators, REINFORCE baselines and GAE written out; PPO's clipped surrogate and value
loss summed over the tokens the policy generated, weighted per token or per sequence; gradient clipping.
Each case sets keys away from their defaults, so a trainer that ignores a key, passes it to the wrong
place or flips a sign computes other gradients: each case's docstring line says which bugs it catches.
The actor is perturbed away from the reference model where a KL term is tested (at the first update
the policy equals the reference, and every KL and its gradient vanish), and the engine's log-probs are
moved off the policy's where clipping is tested (at ratio 1 the clip is inactive).
"""

import json
from dataclasses import asdict, dataclass, field

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from conftest import run_python
from test_grpo_reference import make_batch
from test_ppo import rl_data  # noqa: F401  (the fixture)

WORKER = "tests/workers/ppo_step_capture.py"
LR, CRITIC_LR, MAX_GRAD_NORM, GROUP_SIZE, EPS = 1e-3, 3e-3, 1.0, 4, 1e-6
MAX_NEW_TOKENS = 12


@dataclass
class Case:
    """One setting of the keys a PPO step reads (rl2's defaults unless set)."""

    why: str
    estimator: str = "reinforce"
    norm_var: bool = False
    global_norm: bool = False
    temperature: float = 1.0
    kl_type: str = "reward"
    kl_coef: float = 0.0
    reward_estimator: str = "k1"
    loss_estimator: str = "k2"
    k3_ratio_correction: bool = False
    clip: float = 0.2
    clip_high: float | None = None
    loss_level: str = "token"
    loss_agg: str | None = None
    clip_c: float | None = None
    recompute_logprobs: bool = True
    gamma: float = 1.0
    lamda: float = 1.0
    critic_clip: float = 0.5
    critic_loss_level: str = "token"
    update_per_rollout: int = 1
    critic_update_per_rollout: int = 1
    freeze_steps: int = 0
    dynamic_filtering: bool = True
    uniform_group: bool = False  # make the second group's rewards all equal
    roc: bool = False  # GRPO-RoC: groups of 8 generated (roc_batch), 4 kept by penalty (topk)
    policy_loss: str = "ppo"
    gspo_clip: float = 3e-4
    gspo_clip_high: float = 4e-4
    rollout_correction: str = "none"
    rejected_tokens: str = "drop"
    correction_threshold: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    tis_coef: float = 0.0
    entropy_coef: float = 0.0
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    overlong_filtering: bool = False
    distill_coef: float = 0.0  # > 0: the teacher is the peaked tiny model (`peaked_model_dir`)
    distill_mode: str = "reward"
    distill_loss_estimator: str = "k2"
    distill_env_reward: bool = True
    perturb: float = 0.0
    logprob_noise: float = 0.0
    max_grad_norm: float = MAX_GRAD_NORM  # larger: the gradient unclipped, so a scaled loss shows
    extra: list[str] = field(default_factory=list)

    def overrides(self) -> list[str]:
        clip_high = "null" if self.clip_high is None else self.clip_high
        return [
            f"data.responses_per_prompt={GROUP_SIZE}", "data.prompts_per_rollout=2", "trainer.total_steps=60",
            f"actor.lr={LR}", f"actor.max_grad_norm={self.max_grad_norm}", "actor.warmup_ratio=0.0",
            "critic.warmup_ratio=0.0", f"critic.lr={CRITIC_LR}",
            f"adv.estimator={self.estimator}", f"adv.norm_var={str(self.norm_var).lower()}",
            f"adv.global_norm={str(self.global_norm).lower()}", f"adv.gamma={self.gamma}", f"adv.lamda={self.lamda}",
            f"rollout.train_sampling_params={{temperature: {self.temperature}, max_new_tokens: {MAX_NEW_TOKENS}}}",
            f"kl.type={self.kl_type}", f"kl.coef={self.kl_coef}", f"kl.reward_estimator={self.reward_estimator}",
            f"kl.loss_estimator={self.loss_estimator}", f"actor.clip={self.clip}", f"actor.clip_high={clip_high}",
            f"kl.k3_ratio_correction={str(self.k3_ratio_correction).lower()}",
            f"actor.loss_level={self.loss_level}", f"actor.recompute_logprobs={str(self.recompute_logprobs).lower()}",
            *([f"actor.loss_agg={self.loss_agg}"] if self.loss_agg else []),
            *([f"actor.clip_c={self.clip_c}"] if self.clip_c else []),
            f"critic.clip={self.critic_clip}", f"critic.loss_level={self.critic_loss_level}",
            f"actor.update_per_rollout={self.update_per_rollout}", f"actor.freeze_steps={self.freeze_steps}",
            f"critic.update_per_rollout={self.critic_update_per_rollout}",
            f"actor.policy_loss={self.policy_loss}", f"actor.gspo_clip={self.gspo_clip}",
            f"actor.gspo_clip_high={self.gspo_clip_high}", f"actor.rollout_correction={self.rollout_correction}",
            f"actor.correction_threshold={self.correction_threshold}", f"actor.icepop_low={self.icepop_low}",
            f"actor.icepop_high={self.icepop_high}", f"actor.tis_coef={self.tis_coef}",
            f"actor.rejected_tokens={self.rejected_tokens}",
            f"actor.entropy_coef={self.entropy_coef}", f"rollout.overlong_buffer={self.overlong_buffer}",
            f"rollout.overlong_penalty={self.overlong_penalty}",
            f"rollout.overlong_filtering={str(self.overlong_filtering).lower()}",
            *([f"adv.resample_on_correct=true", f"rollout.oversample={2 * GROUP_SIZE}", "adv.roc_mode=topk",
               "adv.roc_min_each=1"] if self.roc else []),
            f"rollout.dynamic_filtering={str(self.dynamic_filtering).lower()}",
            f"distill.coef={self.distill_coef}", f"distill.mode={self.distill_mode}",
            f"distill.loss_estimator={self.distill_loss_estimator}",
            f"distill.env_reward={str(self.distill_env_reward).lower()}", *self.extra,
        ]


CASES = {
    "grpo-temperature": Case("policy log-probs at the sampling temperature (T=1 while sampling at 0.7); GRPO's "
                             "group std", norm_var=True, temperature=0.7),
    "global-norm": Case("adv.global_norm ignored (group instead of batch baseline and std)", norm_var=True,
                        global_norm=True),
    "kl-reward": Case("the KL penalty's sign in the REINFORCE score; kl.type / kl.coef / kl.reward_estimator "
                      "ignored", kl_type="reward", kl_coef=0.5, reward_estimator="k3", perturb=0.02),
    "kl-loss": Case("the KL loss's sign; kl.loss_estimator ignored", kl_type="loss", kl_coef=0.5,
                    loss_estimator="k3", perturb=0.02),
    "kl-loss-ratio-correction": Case("kl.k3_ratio_correction ignored (TRL's pi / pi_old on the KL loss)",
                                     kl_type="loss", kl_coef=0.5, loss_estimator="k3", perturb=0.02,
                                     k3_ratio_correction=True, recompute_logprobs=False, logprob_noise=0.3),
    "clip-engine-logprobs": Case("actor.clip / clip_high ignored or swapped; old log-probs not the engine's with "
                                 "recompute_logprobs=false; loss_level=sequence ignored", clip=0.1, clip_high=0.3,
                                 recompute_logprobs=False, logprob_noise=0.3, loss_level="sequence"),
    "gae": Case("the critic trained toward the advantages (not the returns); GAE's gamma / lamda, critic.clip and "
                "the KL reward on GAE's path ignored", estimator="gae", gamma=0.9, lamda=0.8, critic_clip=0.05,
                kl_type="reward", kl_coef=0.5, perturb=0.02, logprob_noise=0.0),
    "freeze-steps": Case("actor.freeze_steps ignored (the actor moves in a frozen step)", estimator="gae",
                         freeze_steps=1),
    "dynamic-filtering": Case("rollout.dynamic_filtering ignored (a group of equal rewards still counts in the "
                              "token mean)", uniform_group=True),
    "no-dynamic-filtering": Case("dynamic filtering applied though switched off", uniform_group=True,
                                 dynamic_filtering=False),
    "gae-critic-minibatches": Case("critic.update_per_rollout / critic.loss_level ignored (the critic's minibatches "
                                   "and averaging taken from the actor's section or the defaults)", estimator="gae",
                                   critic_update_per_rollout=2, critic_loss_level="sequence"),
    "kl-temperature": Case("the reference's log-probs not at the sampling temperature (the KL penalty compares "
                           "policies at two temperatures)", kl_type="reward", kl_coef=0.5, reward_estimator="k2",
                           temperature=0.7, perturb=0.02),
    "gspo": Case("actor.policy_loss=gspo ignored (PPO's token ratios instead of one per sequence), or gspo_clip / "
                 "gspo_clip_high ignored", policy_loss="gspo", gspo_clip=0.01, gspo_clip_high=0.08,
                 recompute_logprobs=False, logprob_noise=0.3, loss_level="sequence"),
    "cispo": Case("actor.policy_loss=cispo ignored (clipped tokens dropped from the gradient, as PPO does), or its "
                  "clip_high ignored", policy_loss="cispo", clip_high=0.1, recompute_logprobs=False, logprob_noise=0.3),
    "tis": Case("actor.rollout_correction=tis ignored, or weights from the wrong log-probs (current instead of "
                "proximal over behaviour), or correction_threshold ignored", rollout_correction="tis",
                correction_threshold=1.1, logprob_noise=0.3),
    "tis-coef": Case("RL2's actor.tis_coef ignored", tis_coef=1.1, logprob_noise=0.3),
    "rloo": Case("adv.estimator=rloo ignored (the group mean taken as the baseline)", estimator="rloo"),
    "dual-clip": Case("actor.clip_c ignored (dual-clip PPO's bound on negative advantages)", clip_c=1.2,
                      logprob_noise=0.5),
    "dr-grpo-loss-agg": Case("actor.loss_agg=seq_mean_token_sum_norm ignored (Dr. GRPO's constant normaliser, "
                             "the run's max_new_tokens)", loss_agg="seq_mean_token_sum_norm"),
    "seq-mean-counts-every-completion": Case("a completion without loss tokens (cut by overlong filtering) left "
                                             "out of the sequence mean's count (verl's agg_loss and TRL's grpo "
                                             "count every completion)", loss_level="sequence", overlong_filtering=True,
                                             max_grad_norm=1e9),
    "dr-grpo-counts-every-completion": Case("the same for Dr. GRPO's sum over (completions x a constant)",
                                            loss_agg="seq_mean_token_sum_norm", overlong_filtering=True,
                                            max_grad_norm=1e9),
    "mis": Case("rejected tokens left in the loss's denominator, or not rejected", rollout_correction="mis",
                correction_threshold=1.1, logprob_noise=0.3),
    "seq-tis": Case("the sequence-level truncated weight (the product of the ratios) not applied",
                    rollout_correction="seq_tis", correction_threshold=1.5, logprob_noise=0.3),
    "geo-mis": Case("whole sequences not rejected by their geometric-mean ratio", rollout_correction="geo_mis",
                    correction_threshold=1.03, logprob_noise=0.3),
    "icepop-keep-rejected": Case("actor.rejected_tokens=keep_in_denominator ignored (rejected tokens dropped from "
                                 "the mean's denominator)", rollout_correction="icepop", icepop_low=0.85,
                                 icepop_high=1.15, rejected_tokens="keep_in_denominator", logprob_noise=0.3),
    "icepop": Case("IcePop's band ignored", rollout_correction="icepop", icepop_low=0.85, icepop_high=1.15,
                   logprob_noise=0.3),
    "decoupled-gae": Case("decoupled PPO's weights not applied on GAE's path", estimator="gae",
                          rollout_correction="decoupled", logprob_noise=0.3),
    "entropy": Case("actor.entropy_coef ignored, its sign flipped, or the entropy not at the sampling temperature",
                    entropy_coef=0.5, temperature=0.7),
    "overlong": Case("rollout.overlong_buffer / overlong_penalty / overlong_filtering ignored (the reward not shaped "
                     "by length, truncated answers still in the loss)", overlong_buffer=8, overlong_penalty=0.5,
                     overlong_filtering=True),
    "grpo-roc": Case("GRPO-RoC's oversampled groups not cut to data.responses_per_prompt, adv.roc_mode ignored, or "
                     "the loss computed on trajectories it dropped", roc=True, norm_var=True),
    "two-minibatches": Case("actor.update_per_rollout ignored (one step on the whole batch instead of one per "
                            "minibatch of whole groups)", update_per_rollout=2),
    "distill-reward": Case("distill.coef ignored, or the teacher's per-token reward's sign flipped, or summed "
                           "other than as the KL penalty is in the REINFORCE score; the teacher's log-probs not "
                           "teacher.model_name's or not at the sampling temperature", distill_coef=0.02,
                           norm_var=True, temperature=0.7),
    "distill-reward-only": Case("distill.env_reward=false ignored (the env reward trains), or dynamic filtering "
                                "dropping the groups of equal env rewards while distilling", distill_coef=0.02,
                                distill_env_reward=False, uniform_group=True),
    "distill-reward-gae": Case("the teacher's per-token rewards not on GAE's per-token path (summed on the last "
                               "token, or missing)", estimator="gae", gamma=0.9, lamda=0.8, distill_coef=0.02),
    "distill-loss": Case("distill.mode=loss ignored (the teacher's signal in the reward instead), the loss's sign, "
                         "distill.loss_estimator ignored, or the gradient through the teacher", distill_coef=0.05,
                         distill_mode="loss", distill_loss_estimator="k3"),
}


def token_logps(model, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token t | tokens before t) at `temperature`, aligned with `ids`, 0 at the first token."""
    logits = model(input_ids=ids[None]).logits[0].float() / temperature
    logps = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), logps])


def token_values(critic, ids: torch.Tensor) -> torch.Tensor:
    """V(state before token t): the head's output at position t - 1, aligned with `ids`, 0 at the first token."""
    return torch.cat([torch.zeros(1), critic(input_ids=ids[None]).logits[0, :-1, 0].float()])


def token_entropy(model, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """H(softmax(logits / T)) of the distribution each token was drawn from, aligned with `ids`, 0 at the first."""
    logps = torch.log_softmax(model(input_ids=ids[None]).logits[0].float() / temperature, dim=-1)[:-1]
    return torch.cat([torch.zeros(1), -(logps.exp() * logps).sum(-1)])


def corrected(case: Case, proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor):
    """(importance weights, mask less the rejected tokens) of one sequence, from each correction's definition."""
    mode, limit = case.rollout_correction, case.correction_threshold
    if case.tis_coef > 0:
        mode, limit = "tis", case.tis_coef
    ratio = torch.exp(proximal - behaviour)
    ones = torch.ones_like(ratio)
    tokens = mask.bool()
    if mode == "none":
        return ones, mask
    if mode == "tis":
        return torch.where(tokens, ratio.clamp(max=limit), ones), mask
    if mode == "mis":
        return torch.where(tokens & (ratio <= limit), ratio, ones), mask * (ratio <= limit)
    if mode == "icepop":
        inside = (ratio >= case.icepop_low) & (ratio <= case.icepop_high)
        return torch.where(tokens & inside, ratio, ones), mask * inside
    if mode == "decoupled":
        return torch.where(tokens, ratio, ones), mask
    if not tokens.any():
        return ones, mask
    product = torch.prod(ratio[tokens])
    level = product if mode.startswith("seq") else product ** (1 / tokens.sum())
    if mode.endswith("tis"):
        return torch.where(tokens, level.clamp(max=limit), ones), mask
    return torch.where(tokens, level, ones) if level <= limit else ones, mask * (level <= limit)


def dapo_penalty(length: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (eq. 13) with L_max = MAX_NEW_TOKENS and L_cache = `buffer`."""
    start = MAX_NEW_TOKENS - buffer
    return 0.0 if length <= start else max((start - length) / buffer, -1.0)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Schulman's estimators of KL(pi || ref) from samples of pi, written with r = ref / pi."""
    log_r = ref_logp - logp
    return {"k1": -log_r, "k2": log_r**2 / 2, "k3": log_r.exp() - 1 - log_r}[estimator]


def baseline_advantages(scores: torch.Tensor, valid: torch.Tensor, group: int, norm_var: bool) -> torch.Tensor:
    """score - mean of its group's valid scores (divided by their unbiased std + eps with norm_var); 0 for
    invalid responses and for groups without two different valid scores."""
    advantages = torch.zeros_like(scores)
    for start in range(0, len(scores), group):
        members = [i for i in range(start, start + group) if valid[i]]
        values = scores[members]
        if len(members) < 2 or values.max() == values.min():
            continue
        centred = values - values.mean()
        advantages[members] = centred / (values.std() + EPS) if norm_var else centred
    return advantages


def gae_reference(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lamda: float):
    """GAE over the action tokens only (tool tokens skipped, the episode ends after the last action)."""
    steps = mask.nonzero().flatten().tolist()
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    next_value = next_advantage = 0.0
    for t in reversed(steps):
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = delta + gamma * lamda * next_advantage
        advantages[t], returns[t] = next_advantage, next_advantage + values[t]
        next_value = values[t]
    return advantages, returns


def weights(masks: list[torch.Tensor], level: str) -> list[torch.Tensor]:
    if level == "token":
        total = sum(m.sum() for m in masks)
        return [m / total for m in masks]
    counted = len(masks)  # every completion, also one without loss tokens (verl's agg_loss, TRL's grpo / dr_grpo)
    if level == "seq_mean_token_sum_norm":  # TRL's dr_grpo: / (sequences x max completion length)
        return [m / (counted * MAX_NEW_TOKENS) for m in masks]
    return [m / (m.sum() * counted) if m.sum() > 0 else m for m in masks]


def reference_step(case: Case, batch: list[dict], captured: dict, model_dir: str, groups: list[int],
                   critic_groups: list[int] | None = None, teacher_dir: str | None = None) -> dict:
    """The gradients (after clipping) of one step of the actor, on the groups `groups` of the batch (a
    minibatch), and of the critic with GAE, on `critic_groups` (default: the same); the other groups only
    count in the batch-wide statistics. With distillation the teacher is `teacher_dir`'s model."""
    critic_groups = groups if critic_groups is None else critic_groups
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.load_state_dict(captured["before"]["actor"])
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = [torch.tensor(row["token_ids"]) for row in batch]
    # The whole batch's statistics: rewards, filtering, the old policy, the reference, the critic.
    rewards = torch.tensor([row["reward"] for row in batch], dtype=torch.float32)
    distilling = case.distill_coef > 0
    if distilling and not case.distill_env_reward:  # the env reward is only measured
        rewards = torch.zeros_like(rewards)
    if case.overlong_buffer:
        rewards += case.overlong_penalty * torch.tensor([dapo_penalty(sum(row["action_mask"]), case.overlong_buffer)
                                                         for row in batch])
    uniform = [g for g in range(len(batch) // GROUP_SIZE)
               if rewards[g * GROUP_SIZE:(g + 1) * GROUP_SIZE].unique().numel() == 1]
    # While distilling no group is dropped: the teacher's signal differs within a group of equal rewards.
    valid = torch.tensor([not (case.dynamic_filtering and not distilling and row["group"] in uniform) for row in batch])
    masks = [torch.tensor(row["action_mask"], dtype=torch.float32) * v
             * (not (case.overlong_filtering and row.get("truncated", False))) for row, v in zip(batch, valid)]
    with torch.no_grad():
        if case.recompute_logprobs:
            old = [token_logps(policy, x, case.temperature) for x in ids]
        else:
            old = [torch.tensor(lp) for lp in captured["logprobs"]]
        ref = [token_logps(reference, x, case.temperature) for x in ids]
        if distilling:
            teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
            teach = [token_logps(teacher, x, case.temperature) for x in ids]
    behaviour = [torch.tensor(lp) for lp in captured["logprobs"]]
    is_weights = []
    for i, mask in enumerate(masks):
        weight, kept = corrected(case, old[i], behaviour[i], mask)
        if case.rejected_tokens == "keep_in_denominator":  # weight 0, still in the mean's denominator
            weight = torch.where(kept.bool() | ~mask.bool(), weight, torch.zeros_like(weight))
        else:
            masks[i] = kept
        is_weights.append(weight)
    kl = [kl_estimate(o, r, case.reward_estimator) * m for o, r, m in zip(old, ref, masks)]
    reward_kl = case.kl_type == "reward" and case.kl_coef > 0
    # The teacher as a reward: -coef x (log p_student - log p_teacher) on each generated token (Thinking Machines').
    dense = ([-case.distill_coef * (o - t) * m for o, t, m in zip(old, teach, masks)]
             if distilling and case.distill_mode == "reward" else [torch.zeros_like(m) for m in masks])
    critic, returns = None, None
    if case.estimator in ("reinforce", "rloo"):
        scores = rewards - (case.kl_coef * torch.stack([k.sum() for k in kl]) if reward_kl else 0)
        scores = scores + torch.stack([d.sum() for d in dense])
        group = len(batch) if case.global_norm else GROUP_SIZE
        if case.estimator == "rloo":  # each score minus the mean of the other valid scores of its group
            per_sequence = torch.zeros_like(scores)
            for start in range(0, len(scores), group):
                members = [i for i in range(start, start + group) if valid[i]]
                for i in members:
                    others = [scores[j] for j in members if j != i]
                    per_sequence[i] = scores[i] - sum(others) / len(others) if others else 0.0
        else:
            per_sequence = baseline_advantages(scores, valid, group, case.norm_var)
        advantages = [a * m for a, m in zip(per_sequence, masks)]
    else:
        critic = AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        critic.load_state_dict(captured["before"]["critic"])
        with torch.no_grad():
            old_values = [token_values(critic, x) for x in ids]
        advantages, returns = [], []
        for i, mask in enumerate(masks):
            token_rewards = (-case.kl_coef * kl[i] if reward_kl else torch.zeros_like(mask)) + dense[i]
            if mask.any():
                token_rewards[int(mask.nonzero().max())] += rewards[i]
            a, r = gae_reference(token_rewards, old_values[i], mask, case.gamma, case.lamda)
            advantages.append(a)
            returns.append(r)
        # RL2's _compute_gae whitens the advantages over the batch's action tokens (unbiased std + float eps)
        action = torch.cat([a[m.bool()] for a, m in zip(advantages, masks)])
        eps = torch.finfo(action.dtype).eps
        advantages = [(a - action.mean()) * m / (action.std() + eps) for a, m in zip(advantages, masks)]
    chosen = [i for i, row in enumerate(batch) if row["group"] in groups]
    result = {}
    if case.freeze_steps == 0:
        actor_weights = weights([masks[i] for i in chosen], case.loss_agg or case.loss_level)
        for i, w in zip(chosen, actor_weights):
            logp = token_logps(policy, ids[i], case.temperature)
            ratio = (logp - old[i]).exp()
            high = case.clip if case.clip_high is None else case.clip_high
            if case.policy_loss == "gspo":  # one ratio per sequence: the geometric mean of its tokens'
                tokens = masks[i].bool() | torch.tensor(batch[i]["action_mask"]).bool()
                s = torch.exp((logp - old[i])[tokens].mean())
                loss = -torch.minimum(s * advantages[i], s.clamp(1 - case.gspo_clip, 1 + case.gspo_clip_high) * advantages[i])
            elif case.policy_loss == "cispo":
                loss = -ratio.detach().clamp(max=1 + high) * advantages[i] * logp
            else:
                loss = -torch.minimum(ratio * advantages[i], ratio.clamp(1 - case.clip, 1 + high) * advantages[i])
                if case.clip_c:  # dual-clip: a negative advantage's loss is at most clip_c |A|
                    loss = torch.where(advantages[i] < 0, torch.minimum(loss, -case.clip_c * advantages[i]), loss)
            loss = loss * is_weights[i]
            if case.kl_type == "loss" and case.kl_coef > 0:
                kl_loss = kl_estimate(logp, ref[i], case.loss_estimator)
                if case.k3_ratio_correction:  # TRL's bias correction: times pi / pi_old
                    kl_loss = kl_loss * (logp - old[i]).exp()
                loss = loss + case.kl_coef * kl_loss
            if distilling and case.distill_mode == "loss":  # the teacher is frozen: no gradient through it
                loss = loss + case.distill_coef * kl_estimate(logp, teach[i], case.distill_loss_estimator)
            if case.entropy_coef:
                loss = loss - case.entropy_coef * token_entropy(policy, ids[i], case.temperature)
            (loss * w).sum().backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), case.max_grad_norm)
        result["actor"] = {name: p.grad for name, p in policy.named_parameters()}
    if critic is not None:
        chosen = [i for i, row in enumerate(batch) if row["group"] in critic_groups]
        critic_weights = weights([masks[i] for i in chosen], case.critic_loss_level)
        for i, w in zip(chosen, critic_weights):
            v = token_values(critic, ids[i])
            clipped = old_values[i] + (v - old_values[i]).clamp(-case.critic_clip, case.critic_clip)
            loss = 0.5 * torch.maximum((v - returns[i]) ** 2, (clipped - returns[i]) ** 2)
            (loss * w).sum().backward()
        torch.nn.utils.clip_grad_norm_(critic.parameters(), MAX_GRAD_NORM)
        result["critic"] = {name: p.grad for name, p in critic.named_parameters()}
    return result


def assert_same_gradients(got: dict, expected: dict, what: str) -> None:
    assert set(got) == set(expected), what
    for name, grad in expected.items():
        # float32 in another order (packed rows vs one sequence): ~1e-6 of the gradient's scale
        scale = grad.abs().max().item()
        torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-4 * scale + 1e-12, msg=f"{what}: {name}")


# GRPO-RoC's penalty (rl2.tools.roc_penalty) of each positive of a group of 8, by the conversation it shows:
# a tool error and a boxed answer (1.0), the same (1.0), a tool error without an answer (2.0), a clean tool
# call and a boxed answer (0.0). topk keeps the lowest two: 0.0 and the first 1.0.
ROC_CONVERSATIONS = {
    1.0: [{"role": "tool", "content": "Traceback (most recent call last):\nValueError: x"},
          {"role": "assistant", "content": "\\boxed{4}"}],
    2.0: [{"role": "tool", "content": "Traceback (most recent call last):\nValueError: x"},
          {"role": "assistant", "content": "I do not know"}],
    0.0: [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "\\boxed{4}"}],
}
ROC_POSITIVE_PENALTIES = [1.0, 1.0, 2.0, 0.0]


def roc_batch(tokenizer) -> list[dict]:
    """Each group of `make_batch` oversampled to 8: its 4 answers, then the same 4 one token longer with their
    rewards flipped (4 positives, 4 negatives); the positives' conversations carry ROC_POSITIVE_PENALTIES."""
    base = make_batch(tokenizer)
    batch = []
    for group in range(len(base) // GROUP_SIZE):
        rows = base[group * GROUP_SIZE:(group + 1) * GROUP_SIZE]
        # The copies end with one more generated token: identical sequences with opposite advantages would
        # cancel in the gradient, leaving rounding noise to compare.
        copies = [{**row, "reward": 1.0 - row["reward"], "token_ids": row["token_ids"] + [row["token_ids"][-1]],
                   "action_mask": row["action_mask"] + [1]} for row in rows]
        members = [dict(row) for row in rows] + copies
        penalties = iter(ROC_POSITIVE_PENALTIES)
        for row in members:
            start = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<tool_call>x</tool_call>"}]
            row["messages"] = start + ROC_CONVERSATIONS[next(penalties)] if row["reward"] > 0 else start
        batch += members
    return batch


def run_case(case: Case, model_dir: str, data: str, tmp_path,
             teacher_dir: str | None = None) -> tuple[list[dict], dict]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = roc_batch(tokenizer) if case.roc else make_batch(tokenizer)
    if case.uniform_group:
        for row in batch[GROUP_SIZE:]:
            row["reward"] = 1.0
    for row in batch:  # an answer without the end-of-turn token was cut at the length limit
        row["truncated"] = row["token_ids"][-1] != tokenizer.eos_token_id
    spec = {"trajectories": batch, "perturb": case.perturb, "logprob_noise": case.logprob_noise}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    teacher = [f"teacher.model_name={teacher_dir}"] if case.distill_coef > 0 else []
    run_python([WORKER, model_dir, f"{data}/train.jsonl", "envs/demo_successor.py", str(tmp_path / "spec.json"),
                str(tmp_path / "out.pt"), *case.overrides(), *teacher])
    return batch, torch.load(tmp_path / "out.pt")


@pytest.mark.parametrize("name", list(CASES))
def test_one_ppo_step_matches_the_reference(name, tiny_model_dir, rl_data, tmp_path, request):
    case = CASES[name]
    teacher_dir = request.getfixturevalue("peaked_model_dir") if case.distill_coef > 0 else None
    batch, captured = run_case(case, tiny_model_dir, rl_data, tmp_path, teacher_dir)
    steps = captured["steps"]
    if case.freeze_steps:
        assert steps["actor"] == []
        for key, value in captured["before"]["actor"].items():
            assert torch.equal(captured["after"]["actor"][key], value), key
    else:
        assert len(steps["actor"]) == case.update_per_rollout
        assert steps["actor"][0]["lr"] == pytest.approx(LR, rel=1e-12)
    if case.roc:  # 4 of each group of 8: its two positives of lowest penalty and two negatives
        kept = captured["kept"]
        assert len(kept) == 2 * GROUP_SIZE and [i // (2 * GROUP_SIZE) for i in kept] == [0] * 4 + [1] * 4, kept
        for group in (0, 1):
            members = [i for i in kept if i // (2 * GROUP_SIZE) == group]
            positives = [i for i in members if batch[i]["reward"] > 0]
            assert [i % (2 * GROUP_SIZE) for i in positives] == [0, 6], kept  # penalties 1.0 (first) and 0.0
        batch = [batch[i] for i in kept]
        captured["logprobs"] = [captured["logprobs"][i] for i in kept]
    # With two minibatches the first is one of the two groups, drawn by the trainer's seeded shuffle: the
    # reference is computed for both and the closer one is compared.
    actor_choices = [[0, 1]] if case.update_per_rollout == 1 else [[0], [1]]
    critic_choices = [[0, 1]] if case.critic_update_per_rollout == 1 else [[0], [1]]
    candidates = [reference_step(case, batch, captured, tiny_model_dir, groups=a, critic_groups=c,
                                 teacher_dir=teacher_dir) for a in actor_choices for c in critic_choices]

    def distance(candidate: dict) -> float:
        total = 0.0
        for model in ("actor", "critic"):
            if model in candidate and steps.get(model):
                first = steps[model][0]["grads"]
                total += max((candidate[model][k] - v).abs().max().item() for k, v in first.items())
        return total

    expected = min(candidates, key=distance)
    if "actor" in expected:
        assert_same_gradients(steps["actor"][0]["grads"], expected["actor"], f"actor ({case.why})")
    if "critic" in expected:
        assert len(steps["critic"]) == case.critic_update_per_rollout
        assert steps["critic"][0]["lr"] == pytest.approx(CRITIC_LR, rel=1e-12)  # the critic's own section
        assert_same_gradients(steps["critic"][0]["grads"], expected["critic"], f"critic ({case.why})")


def test_each_case_moves_the_step():
    """The grid is not vacuous: the settings each case tests are away from the defaults."""
    defaults = asdict(Case(""))
    for name, case in CASES.items():
        changed = {k for k, v in asdict(case).items() if v != defaults[k] and k not in ("why", "perturb", "logprob_noise")}
        assert changed, name


SKIPPED_PROXIMAL_CASES = {
    "kl-loss-entropy": Case("", kl_type="loss", kl_coef=0.5, loss_estimator="k3", perturb=0.02, logprob_noise=0.3,
                            temperature=0.7, entropy_coef=0.5, k3_ratio_correction=True),
    "gspo-gae": Case("", policy_loss="gspo", gspo_clip=0.01, gspo_clip_high=0.08, loss_level="sequence",
                     estimator="gae", logprob_noise=0.3),
}


@pytest.mark.parametrize("name", list(SKIPPED_PROXIMAL_CASES))
def test_proximal_log_probs_from_the_update_are_bit_identical(name, tiny_model_dir, rl_data, tmp_path):
    """actor.proximal_from_update: the old log-probs taken from the update's own forward pass instead of a
    separate one give the same step bit for bit: gradients, weights after, every metric."""
    case = SKIPPED_PROXIMAL_CASES[name]
    runs = {}
    for skip in (True, False):
        folder = tmp_path / str(skip)
        folder.mkdir()
        separate = Case(**{**asdict(case), "extra": [f"actor.proximal_from_update={str(skip).lower()}"]})
        runs[skip] = run_case(separate, tiny_model_dir, rl_data, folder)[1]
    skipped, computed = runs[True], runs[False]
    assert (skipped["actor_compute_calls"], computed["actor_compute_calls"]) == (0, 1)
    for key, grad in computed["steps"]["actor"][0]["grads"].items():
        assert torch.equal(skipped["steps"]["actor"][0]["grads"][key], grad), key
    for key, weight in computed["after"]["actor"].items():
        assert torch.equal(skipped["after"]["actor"][key], weight), key
    timing = ("time/", "tokens_per_second")
    metrics = {k: v for k, v in computed["metrics"].items() if not k.startswith(timing)}
    assert {k for k in skipped["metrics"] if not k.startswith(timing)} == set(metrics)
    assert "offpolicy/kl_k3" in metrics and metrics["logp_mismatch/max"] > 0
    for key, value in metrics.items():
        assert skipped["metrics"][key] == value, key
