"""Rollout corrections, the policy losses and overlong shaping against the papers' equations, written out here
in float64 on hand-made sequences whose ratios sit on both sides of every clip and threshold.

Sources: truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"); masked IS and its sequence / geometric forms (Liu, Li et al. 2025, "When speed kills stability");
IcePop (Ring-1T, 2025); decoupled PPO (Hilton et al. 2021); GSPO (Zheng et al. 2025, eq. 5-7); CISPO
(MiniMax-M1, 2025, eq. 4); DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).
"""

import math

import pytest
import torch

from rl2.algorithms.losses import cispo_loss, gspo_loss, policy_loss, sequence_index
from rl2.algorithms.off_policy import Correction, correction_weights, mismatch_metrics
from rl2.algorithms.overlong import overlong_penalty

C = 2.0
# Per-token ratios pi_prox / pi_behav of two sequences, on both sides of C = 2 and of IcePop's [0.5, 5]:
# the first holds a prompt token (mask 0) with a wild ratio that no correction may look at.
RATIOS = [[1e9, 0.3, 0.7, 1.1, 1.9, 2.1], [0.49, 0.51, 1.0, 4.9, 5.1]]
MASKS = [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]


def sequences(ratios=RATIOS, masks=MASKS):
    """(proximal, behaviour, mask) per sequence, float64, with behaviour log-probs that vary by token."""
    out = []
    for rho, mask in zip(ratios, masks):
        behaviour = torch.tensor([-0.5 - 0.25 * i for i in range(len(rho))], dtype=torch.float64)
        out.append((behaviour + torch.tensor(rho, dtype=torch.float64).log(), behaviour, torch.tensor(mask)))
    return out


def paper_weights(mode: str, rho: list[float], mask: list[int]) -> tuple[list[float], list[int]]:
    """Each mode's weight and kept tokens, written from its definition (plain floats)."""
    actions = [r for r, m in zip(rho, mask) if m]
    product = math.prod(actions)
    geometric = product ** (1 / len(actions))
    weights, keep = [], []
    for r, m in zip(rho, mask):
        if not m:
            weights.append(1.0)
            keep.append(0)
            continue
        w, k = {
            "none": (1.0, True),
            "tis": (min(r, C), True),
            "mis": (r, r <= C),
            "icepop": (r, 0.5 <= r <= 5.0),
            "decoupled": (r, True),
            "seq_tis": (min(product, C), True),
            "geo_tis": (min(geometric, C), True),
            "seq_mis": (product, product <= C),
            "geo_mis": (geometric, geometric <= C),
        }[mode]
        weights.append(w if k else 1.0)
        keep.append(int(k))
    return weights, keep


@pytest.mark.parametrize("mode", ["none", "tis", "mis", "icepop", "decoupled", "seq_tis", "geo_tis", "seq_mis",
                                  "geo_mis"])
def test_each_correction_is_its_definition(mode):
    correction = Correction(mode, threshold=C, low=0.5, high=5.0)
    for (proximal, behaviour, mask), rho, m in zip(sequences(), RATIOS, MASKS):
        weights, keep = correction_weights(proximal, behaviour, mask, correction)
        expected_weights, expected_keep = paper_weights(mode, rho, m)
        torch.testing.assert_close(weights, torch.tensor(expected_weights, dtype=torch.float64), rtol=1e-12, atol=0)
        assert keep.int().tolist() == expected_keep, mode
        assert not weights.requires_grad


def test_the_corrections_reject_and_truncate_where_expected():
    """The hand-made ratios do exercise every branch: each token-level threshold is crossed both ways."""
    (p1, b1, m1), (p2, b2, m2) = sequences()
    _, keep = correction_weights(p1, b1, m1, Correction("mis", C))
    assert keep.tolist() == [False, True, True, True, True, False]  # 2.1 > C rejected, the prompt token never kept
    _, keep = correction_weights(p2, b2, m2, Correction("icepop", C, 0.5, 5.0))
    assert keep.tolist() == [False, True, True, True, False]  # 0.49 below, 5.1 above
    weights, _ = correction_weights(p1, b1, m1, Correction("tis", C))
    assert weights[-1] == C and weights[1] == pytest.approx(0.3)
    # The first sequence's product is 0.3 * 0.7 * 1.1 * 1.9 * 2.1 = 0.922 (kept), the second's 6.0 (rejected).
    assert correction_weights(p2, b2, m2, Correction("seq_mis", C))[1].sum() == 0


def test_a_product_over_a_long_sequence_does_not_overflow():
    """10,000 tokens at ratio 1.5: the product is e^4055; its log is clamped at 20 first, so the truncated
    weight is C and the masked one rejects, with no inf or NaN."""
    length = 10_000
    behaviour = torch.zeros(length, dtype=torch.float64)
    proximal = torch.full((length,), math.log(1.5), dtype=torch.float64)
    mask = torch.ones(length)
    weights, keep = correction_weights(proximal, behaviour, mask, Correction("seq_tis", C))
    assert torch.isfinite(weights).all() and (weights == C).all()
    assert not correction_weights(proximal, behaviour, mask, Correction("seq_mis", C))[1].any()


def test_mismatch_metrics():
    batch = sequences()
    metrics = mismatch_metrics([p for p, _, _ in batch], [b for _, b, _ in batch], [m for _, _, m in batch], C)
    actions = [r for rho, mask in zip(RATIOS, MASKS) for r, m in zip(rho, mask) if m]
    assert metrics["offpolicy/kl_k1"] == pytest.approx(sum(-math.log(r) for r in actions) / len(actions))
    assert metrics["offpolicy/kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r in actions) / len(actions))
    outside = [r for r in actions if r < 1 / C or r > C]  # 0.3, 2.1, 0.49, 4.9, 5.1
    assert metrics["offpolicy/token_ratio_outside"] == pytest.approx(len(outside) / len(actions))
    assert metrics["offpolicy/sequence_ratio_outside"] == 0.5  # 0.922 inside, 6.0 outside
    assert metrics["offpolicy/max_ratio"] == pytest.approx(5.1)


# ---- the policy losses -------------------------------------------------------------------

def packed_batch():
    """Three sequences packed in one row (lengths 4, 3, 5), float64, with action masks, log-probs of the
    current and the old policy whose ratios straddle every clip, and one advantage per sequence (GRPO)."""
    lengths = [4, 3, 5]
    cu_seqlens = torch.tensor([0, 4, 7, 12])
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1], dtype=torch.float64)
    old = torch.tensor([-1.0, -0.6, -1.3, -0.4, -2.0, -0.9, -0.2, -1.1, -0.7, -1.6, -0.3, -0.8], dtype=torch.float64)
    shift = torch.tensor([0.0, 0.3, -0.35, 0.02, 0.0, -0.0002, 0.0005, 0.0, 0.4, -0.5, 0.1, -0.2], dtype=torch.float64)
    advantages = torch.tensor([1.5] * 4 + [-0.7] * 3 + [-0.9] * 5, dtype=torch.float64)
    return lengths, cu_seqlens, mask, old, old + shift, advantages


def test_sequence_index():
    assert sequence_index(torch.tensor([0, 4, 7, 12]), 12).tolist() == [0] * 4 + [1] * 3 + [2] * 5


@pytest.mark.parametrize("clip, clip_high", [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_is_the_papers_objective(clip, clip_high):
    """GSPO (eq. 5-7): J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - e_low, 1 + e_high) A_i), s_i = (pi(y_i) /
    pi_old(y_i))^(1/|y_i|). rl2's per-token loss weighted per sequence (loss_level=sequence) is -J, in
    value and in gradient."""
    lengths, cu_seqlens, mask, old, current, advantages = packed_batch()
    logps = current.clone().requires_grad_(True)
    loss, clipped = gspo_loss(logps, old, advantages, mask, cu_seqlens, clip, clip_high)
    weights = torch.cat([m / (m.sum() * len(lengths)) for m in mask.split(lengths)])  # loss_level=sequence, float64
    ours = (loss * weights).sum()
    ours.backward()

    reference_logps = current.clone().requires_grad_(True)
    objective = 0
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        m = mask[start:end].bool()
        s = torch.exp((reference_logps[start:end][m] - old[start:end][m]).mean())
        a = advantages[start]
        objective = objective + torch.minimum(s * a, s.clamp(1 - clip, 1 + clip_high) * a)
    objective = objective / len(lengths)
    (-objective).backward()
    torch.testing.assert_close(ours, -objective, rtol=1e-12, atol=0)
    torch.testing.assert_close(logps.grad, reference_logps.grad, rtol=1e-10, atol=1e-14)
    # Sequence ratios 0.990 (A > 0), 1.00015 (A < 0) and 0.951 (A < 0): at GSPO's clips only the third leaves
    # the band in its advantage's direction (all its tokens clipped); PPO-sized clips hold all three.
    expected = [0] * 7 + [1] * 5 if clip == 3e-4 else [0] * 12
    assert clipped.tolist() == expected


def test_gspo_clips_whole_sequences():
    """A sequence whose ratio leaves the band carries no gradient at all (all its tokens clipped together);
    one inside it moves every one of its tokens."""
    lengths, cu_seqlens, mask, old, current, advantages = packed_batch()
    logps = current.clone().requires_grad_(True)
    loss, _ = gspo_loss(logps, old, advantages, mask, cu_seqlens, 3e-4, 4e-4)
    (loss * mask).sum().backward()
    grad = logps.grad
    s = [math.exp(((current - old)[a:b][mask[a:b].bool()]).mean().item()) for a, b in ((0, 4), (4, 7), (7, 12))]
    assert abs(s[1] - 1) < 3e-4 and (grad[5:7] != 0).all()  # inside the band
    for (a, b), ratio, advantage in zip(((0, 4), (7, 12)), (s[0], s[2]), (1.5, -0.9)):
        outside_in_the_direction_of_a = (ratio > 1 + 4e-4) if advantage > 0 else (ratio < 1 - 3e-4)
        assert outside_in_the_direction_of_a == bool((grad[a:b] == 0).all())


def test_cispo_is_the_papers_objective():
    """CISPO (eq. 4): J = 1/(sum_i |o_i|) sum_i sum_t sg(clip(r_t, 1 - e_low, 1 + e_high)) A_t log pi(o_t), no lower
    bound (e_low large, as the paper sets it). rl2's per-token loss weighted per token is -J; a token whose ratio
    passes the clip still has its gradient, only weighted less (PPO would drop it)."""
    lengths, cu_seqlens, mask, old, current, advantages = packed_batch()
    clip_high = 0.2
    logps = current.clone().requires_grad_(True)
    loss, clipped = cispo_loss(logps, old, advantages, clip_high)
    weights = mask / mask.sum()  # loss_level=token, float64
    ours = (loss * weights).sum()
    ours.backward()

    reference_logps = current.clone().requires_grad_(True)
    ratio = torch.exp(current - old)
    objective = (ratio.clamp(max=1 + clip_high) * advantages * reference_logps * mask).sum() / mask.sum()
    (-objective).backward()
    torch.testing.assert_close(ours, -objective, rtol=1e-12, atol=0)
    torch.testing.assert_close(logps.grad, reference_logps.grad, rtol=1e-12, atol=0)
    assert clipped.nonzero().flatten().tolist() == [1, 8]  # the tokens at ratios e^0.3 and e^0.4, above 1.2
    assert (logps.grad[mask.bool()] != 0).all()


def test_decoupled_ppo_is_hiltons_objective():
    """Decoupled PPO (Hilton et al. 2021, eq. 4): L = -E[(pi_prox / pi_behav) min(r A, clip(r, 1 - e, 1 + e) A)]
    with r = pi / pi_prox: rl2's PPO loss (clipped against the recomputed, proximal log-probs) times the
    `decoupled` correction's weights."""
    lengths, cu_seqlens, mask, proximal, current, advantages = packed_batch()
    behaviour = proximal - torch.linspace(-0.6, 0.6, len(proximal), dtype=torch.float64)
    weights = torch.cat([correction_weights(p, b, m, Correction("decoupled"))[0] for p, b, m in
                         zip(proximal.split(lengths), behaviour.split(lengths), mask.split(lengths))])
    logps = current.clone().requires_grad_(True)
    per_token, _ = policy_loss(logps, proximal, advantages, 0.2)
    ours = (per_token * weights * mask).sum() / mask.sum()
    ours.backward()

    reference_logps = current.clone().requires_grad_(True)
    r = torch.exp(reference_logps - proximal)
    objective = (torch.exp(proximal - behaviour) * torch.minimum(r * advantages, r.clamp(0.8, 1.2) * advantages)
                 * mask).sum() / mask.sum()
    (-objective).backward()
    torch.testing.assert_close(ours, -objective, rtol=1e-12, atol=0)
    torch.testing.assert_close(logps.grad, reference_logps.grad, rtol=1e-12, atol=0)


# ---- overlong shaping ----------------------------------------------------------------------

@pytest.mark.parametrize("length, expected", [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (40, -1.0)])
def test_overlong_penalty_is_dapos(length, expected):
    """DAPO (eq. 13) with L_max = 16 and L_cache = 4: 0 up to 12 tokens, ((L_max - L_cache) - |y|) / L_cache
    in between, -1 at and beyond L_max."""
    assert overlong_penalty(length, max_length=16, buffer=4) == pytest.approx(expected)
    assert overlong_penalty(length, max_length=16, buffer=0) == 0.0  # off


def test_the_defaults_give_todays_loss_bit_for_bit():
    """rollout_correction=none, policy_loss=ppo and no entropy bonus: the actor's loss is PPO's clipped
    surrogate weighted per token, as before these keys existed, to the bit; no importance weights are made."""
    from rl2.config import load_config
    from rl2.algorithms.off_policy import rollout_correction
    from rl2.trainer.ppo_stages import actor_loss
    from rl2.trainer.step_plan import StepPlan

    config = load_config([])
    assert rollout_correction(config.actor, config.rollout) == Correction("none", 2.0, 0.5, 5.0)  # auto: none without partial rollout
    lengths, cu_seqlens, mask, old, current, advantages = packed_batch()
    to32 = lambda t: t.float()[None]  # noqa: E731  (a packed row [1, T], float32 as the trainer holds it)
    batch = {"old_logps": to32(old), "advantages": to32(advantages), "loss_mask": to32(mask),
             "loss_weight": to32(mask / mask.sum()), "metric_weight": to32(mask / mask.sum()), "cu_seqlens": cu_seqlens.int(), "engine_logps": to32(old)}
    outputs = {"logps": to32(current).requires_grad_(True), "entropy": torch.rand(1, 12)}
    loss, _ = actor_loss(StepPlan.from_config(config, train_max_new_tokens=8), outputs, batch)
    per_token, _ = policy_loss(outputs["logps"], batch["old_logps"], batch["advantages"], 0.2, None)
    assert torch.equal(loss, (per_token * batch["loss_weight"]).sum())
    proximal, behaviour, m = sequences()[0]
    weights, keep = correction_weights(proximal, behaviour, m, Correction())
    assert torch.equal(weights, torch.ones_like(weights)) and torch.equal(keep, m.bool())
