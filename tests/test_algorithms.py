import math

import pytest
import torch

from rl2.algorithms.advantages import gae, group_advantages, trajectory_advantages, uniform_groups
from rl2.algorithms.losses import kl_penalty, loss_weights, masked_mean, policy_loss, value_loss


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(n: int, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=g, dtype=torch.float64) * scale


# ---------------------------------------------------------------- kl_penalty


def test_kl_estimators_match_formulas():
    g = gen(0)
    logps, ref = -randn(50, g).abs(), -randn(50, g).abs()
    for name in ("k1", "k2", "k3"):
        out = kl_penalty(logps, ref, name)
        for i in range(50):
            d = logps[i].item() - ref[i].item()
            expected = {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(-d) - 1 + d}[name]
            assert out[i].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_k1_k3_unbiased_and_k3_nonnegative():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.2, 0.2, 0.1], dtype=torch.float64)
    true_kl = sum(p[i].item() * math.log(p[i].item() / q[i].item()) for i in range(5))
    n = 200_000
    x = torch.multinomial(p, n, replacement=True, generator=gen(1))
    logps, ref = p.log()[x], q.log()[x]
    for name in ("k1", "k3"):
        est = kl_penalty(logps, ref, name)
        stderr = est.std().item() / math.sqrt(n)
        assert abs(est.mean().item() - true_kl) < 4 * stderr, name
    # k3 has lower variance than k1 here, and is never negative.
    assert kl_penalty(logps, ref, "k3").std() < kl_penalty(logps, ref, "k1").std()
    wide = randn(10_000, gen(2), scale=3.0)
    assert (kl_penalty(wide, torch.zeros_like(wide), "k3") >= 0).all()


def test_kl_gradients_flow():
    g = gen(3)
    logps, ref = randn(20, g).requires_grad_(), randn(20, g)
    kl_penalty(logps, ref, "k2").sum().backward()
    assert torch.allclose(logps.grad, (logps - ref).detach())
    logps.grad = None
    kl_penalty(logps, ref, "k3").sum().backward()
    assert torch.allclose(logps.grad, (1 - torch.exp(-(logps - ref))).detach())


def test_kl_bad_name():
    with pytest.raises(ValueError, match="k4.*k1"):
        kl_penalty(torch.zeros(3), torch.zeros(3), "k4")


# ---------------------------------------------------------------- gae


def gae_reference(rewards, values, mask, gamma, lamda):
    """Backward loop over the list of action positions, skipping masked ones."""
    n = len(rewards)
    adv, ret = [0.0] * n, [0.0] * n
    steps = [t for t in range(n) if mask[t]]
    last_adv = 0.0
    for j in reversed(range(len(steps))):
        t = steps[j]
        next_value = values[steps[j + 1]] if j + 1 < len(steps) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last_adv = delta + gamma * lamda * last_adv
        adv[t] = last_adv
        ret[t] = last_adv + values[t]
    return adv, ret


def check_gae(rewards, values, mask, gamma, lamda):
    adv, ret = gae(rewards, values, mask, gamma, lamda)
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lamda)
    assert adv.shape == rewards.shape and ret.shape == rewards.shape
    assert torch.allclose(adv, torch.tensor(ref_adv, dtype=adv.dtype), atol=1e-10)
    assert torch.allclose(ret, torch.tensor(ref_ret, dtype=ret.dtype), atol=1e-10)
    return adv, ret


def test_gae_no_mask():
    g = gen(4)
    rewards, values = randn(30, g), randn(30, g)
    check_gae(rewards, values, torch.ones(30), 0.99, 0.95)


def test_gae_tool_tokens_are_skipped():
    g = gen(5)
    rewards, values = randn(40, g), randn(40, g)
    mask = torch.zeros(40, dtype=torch.bool)
    mask[5:15] = True  # first turn
    mask[22:30] = True  # second turn, after a tool output at 15:22
    mask[33:37] = True
    adv, ret = check_gae(rewards, values, mask, 0.9, 0.8)
    # Equal to GAE on the action-only subsequence, scattered back; zeros elsewhere.
    sub_adv, sub_ret = gae(rewards[mask], values[mask], torch.ones(int(mask.sum())), 0.9, 0.8)
    assert torch.allclose(adv[mask], sub_adv) and torch.allclose(ret[mask], sub_ret)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    # Garbage at masked positions must not matter.
    noisy_r, noisy_v = rewards.clone(), values.clone()
    noisy_r[~mask], noisy_v[~mask] = 1e6, -1e6
    adv2, ret2 = gae(noisy_r, noisy_v, mask.float(), 0.9, 0.8)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_gae_monte_carlo_when_gamma_lamda_one():
    g = gen(6)
    rewards, values = randn(12, g), randn(12, g)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 1, 0])
    adv, ret = check_gae(rewards, values, mask, 1.0, 1.0)
    steps = [t for t in range(12) if mask[t]]
    for j, t in enumerate(steps):
        future = sum(rewards[s].item() for s in steps[j:])
        assert ret[t].item() == pytest.approx(future, abs=1e-10)
        assert adv[t].item() == pytest.approx(future - values[t].item(), abs=1e-10)


def test_gae_lamda_zero_is_one_step_td():
    g = gen(7)
    rewards, values = randn(10, g), randn(10, g)
    mask = torch.tensor([1, 1, 0, 0, 1, 1, 1, 0, 1, 0])
    adv, _ = check_gae(rewards, values, mask, 0.7, 0.0)
    steps = [t for t in range(10) if mask[t]]
    for j, t in enumerate(steps):
        next_value = values[steps[j + 1]].item() if j + 1 < len(steps) else 0.0
        assert adv[t].item() == pytest.approx(rewards[t].item() + 0.7 * next_value - values[t].item(), abs=1e-12)


def test_gae_all_masked_and_no_grad():
    adv, ret = gae(torch.ones(5), torch.ones(5), torch.zeros(5), 0.99, 0.95)
    assert torch.equal(adv, torch.zeros(5)) and torch.equal(ret, torch.zeros(5))
    values = torch.randn(6, generator=gen(8), requires_grad=True)
    adv, ret = gae(torch.ones(6), values, torch.ones(6), 1.0, 0.9)
    assert not adv.requires_grad and not ret.requires_grad


# ---------------------------------------------------------------- group_advantages


def group_reference(rewards, group_size, norm_var, eps):
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1)) if len(group) > 1 else 0.0
        for r in group:
            if len(group) == 1:
                out.append(0.0)
            else:
                out.append((r - mean) / (std + eps) if norm_var else r - mean)
    return out


@pytest.mark.parametrize("norm_var", [True, False])
@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_group_advantages_vs_loops(norm_var, group_size):
    rewards = randn(32, gen(9))
    out = group_advantages(rewards, group_size, norm_var)
    ref = group_reference(rewards.tolist(), group_size, norm_var, 1e-6)
    assert torch.allclose(out, torch.tensor(ref, dtype=out.dtype), atol=1e-10)
    assert not out.isnan().any()


def test_group_advantages_known_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    out = group_advantages(rewards, 4, norm_var=True, eps=0.0)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(out[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std)
    assert torch.equal(out[4:], torch.zeros(4))  # equal rewards: zero advantage, not NaN
    assert torch.equal(group_advantages(rewards, 4, norm_var=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.equal(group_advantages(rewards, 1, norm_var=True), torch.zeros(8))


@pytest.mark.parametrize("norm_var", [True, False])
def test_group_advantages_equal_rewards_exactly_zero(norm_var):
    # float32 mean of seven 0.7s is off by an ulp; dividing by the std would blow it up.
    rewards = torch.tensor([0.7] * 7 + [0.1] * 7 + [0.3] * 6 + [1.0], dtype=torch.float32)
    out = group_advantages(rewards, 7, norm_var)
    assert torch.equal(out[:14], torch.zeros(14))
    assert (out[14:] != 0).all()


def test_group_advantages_bad_length():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(7), 4, norm_var=True)


def reinforce(rewards, group_size, norm_var, global_norm=False, valid=None, lengths=None, kl=None, kl_coef=0.0):
    """trajectory_advantages(estimator="reinforce") of one trajectory per reward, masks of `lengths` ones."""
    lengths = lengths or [2] * len(rewards)
    valid = torch.tensor(valid if valid is not None else [True] * len(rewards))
    masks = [torch.ones(n) for n in lengths]
    advantages, returns = trajectory_advantages(
        torch.tensor(rewards), valid, masks, "reinforce", group_size, norm_var=norm_var, global_norm=global_norm,
        kl=kl, kl_coef=kl_coef,
    )
    assert returns is None
    for advantage, mask in zip(advantages, masks):
        assert torch.equal(advantage, advantage[0] * mask)  # one value per trajectory, on its action tokens
    return [advantage[0].item() for advantage in advantages]


def test_one_response_per_prompt_uses_the_batch_mean_as_baseline():
    """RL2: `if responses_per_prompt == 1 or global_norm: baseline = rewards.mean(); std = rewards.std()`."""
    assert reinforce([1.0, 0.0, 0.0, 1.0, 1.0], 1, norm_var=False) == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4])
    std = math.sqrt((3 * 0.4**2 + 2 * 0.6**2) / 4)  # unbiased, over the batch: sqrt(0.3)
    assert reinforce([1.0, 0.0, 0.0, 1.0, 1.0], 1, norm_var=True) == pytest.approx(
        [0.4 / std, -0.6 / std, -0.6 / std, 0.4 / std, 0.4 / std], rel=1e-5)
    # An excluded trajectory (reward 0 as passed, valid False) is in neither the mean nor the std, and gets 0.
    assert reinforce([1.0, 0.0, 0.0, 1.0], 1, norm_var=False, valid=[True, True, False, True]) == pytest.approx(
        [1 / 3, -2 / 3, 0.0, 1 / 3])
    assert reinforce([1.0, 0.0, 0.0, 1.0], 1, norm_var=True, valid=[True, True, False, True]) == pytest.approx(
        [1 / 3 / math.sqrt(1 / 3), -2 / 3 / math.sqrt(1 / 3), 0.0, 1 / 3 / math.sqrt(1 / 3)], rel=1e-5)
    assert reinforce([0.5, 0.5, 0.5], 1, norm_var=True) == [0.0, 0.0, 0.0]  # all equal: exactly 0, not NaN
    assert reinforce([0.7, 0.0], 1, norm_var=True, valid=[True, False]) == [0.0, 0.0]  # one valid: its own mean


def test_global_norm_takes_baseline_and_std_over_the_batch():
    """Groups [1, 0] and [1, 1]: per group (GRPO) the second has no signal; with global_norm the batch mean
    0.75 and unbiased batch std 0.5 apply to every trajectory (RL2's adv.global_norm); without norm_var
    only the baseline changes."""
    rewards = [1.0, 0.0, 1.0, 1.0]
    assert reinforce(rewards, 2, norm_var=False) == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert reinforce(rewards, 2, norm_var=True) == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5), 0.0, 0.0], rel=1e-5)
    assert reinforce(rewards, 2, norm_var=False, global_norm=True) == pytest.approx([0.25, -0.75, 0.25, 0.25])
    assert reinforce(rewards, 2, norm_var=True, global_norm=True) == pytest.approx([0.5, -1.5, 0.5, 0.5], rel=1e-5)
    # Excluded trajectories stay out of the batch statistics: [1, 0, 1] -> mean 2/3, std sqrt(1/3).
    out = reinforce(rewards, 2, norm_var=True, global_norm=True, valid=[True, True, True, False])
    assert out == pytest.approx([(1 / 3) / math.sqrt(1 / 3), (-2 / 3) / math.sqrt(1 / 3), (1 / 3) / math.sqrt(1 / 3), 0.0],
                                rel=1e-5)


def test_batch_baseline_applies_to_scores_with_the_kl_penalty():
    """With kl.type=reward the score is the reward minus kl_coef x the trajectory's summed KL, then the batch baseline."""
    kl = [torch.tensor([0.5, 0.5]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])]
    scores = [1.0 - 0.5 * 1.0, 0.0, 1.0 - 0.5 * 2.0]  # 0.5, 0, 0 -> mean 1/6
    assert reinforce([1.0, 0.0, 1.0], 1, norm_var=False, kl=kl, kl_coef=0.5) == pytest.approx(
        [s - 1 / 6 for s in scores])


# ---------------------------------------------------------------- policy_loss


def policy_reference(logps, old_logps, advantages, clip, clip_high):
    losses, clipped = [], []
    for lp, old, a in zip(logps, old_logps, advantages):
        ratio = math.exp(lp - old)
        unclipped = ratio * a
        clipped_term = min(max(ratio, 1 - clip), 1 + clip_high) * a
        losses.append(-min(unclipped, clipped_term))
        clipped.append(1.0 if clipped_term < unclipped else 0.0)
    return losses, clipped


@pytest.mark.parametrize("clip_high", [None, 0.28])
def test_policy_loss_vs_reference_and_gradients(clip_high):
    g = gen(10)
    n = 200
    old = randn(n, g) - 2
    logps = (old + randn(n, g, scale=0.3)).requires_grad_()
    advantages = randn(n, g)
    loss, clipped = policy_loss(logps, old, advantages, 0.2, clip_high)
    ref_loss, ref_clipped = policy_reference(
        logps.tolist(), old.tolist(), advantages.tolist(), 0.2, 0.2 if clip_high is None else clip_high
    )
    assert torch.allclose(loss, torch.tensor(ref_loss, dtype=loss.dtype), atol=1e-12)
    assert clipped.tolist() == ref_clipped
    assert clipped.dtype.is_floating_point
    assert 20 < clipped.sum() < n - 20  # both regimes are exercised
    loss.sum().backward()
    on = clipped.bool()
    assert (logps.grad[on] == 0).all()
    assert (logps.grad[~on] != 0).all()
    # Where not clipped the gradient is that of -ratio * A.
    ratio = torch.exp(logps - old).detach()
    assert torch.allclose(logps.grad[~on], (-ratio * advantages)[~on])


def test_policy_loss_clip_higher():
    old = torch.zeros(1)
    up = torch.tensor([math.log(1.25)])
    pos = torch.ones(1)
    loss, clipped = policy_loss(up, old, pos, clip=0.2)
    assert clipped.item() == 1.0 and loss.item() == pytest.approx(-1.2)
    loss, clipped = policy_loss(up, old, pos, clip=0.2, clip_high=0.28)
    assert clipped.item() == 0.0 and loss.item() == pytest.approx(-1.25)
    # The lower bound stays at 1 - clip: ratio 0.7 with A < 0 is clipped either way.
    down = torch.tensor([math.log(0.7)])
    for clip_high in (None, 0.28):
        loss, clipped = policy_loss(down, old, -pos, clip=0.2, clip_high=clip_high)
        assert clipped.item() == 1.0 and loss.item() == pytest.approx(0.8)
    # ...but not with A > 0 (the unclipped term is the smaller one: moving up is not held back).
    loss, clipped = policy_loss(down, old, pos, clip=0.2)
    assert clipped.item() == 0.0 and loss.item() == pytest.approx(-0.7)


# ---------------------------------------------------------------- value_loss


def test_value_loss_vs_reference():
    g = gen(11)
    n = 200
    old, returns = randn(n, g), randn(n, g)
    values = old + randn(n, g, scale=0.5)
    loss, clipped = value_loss(values, old, returns, 0.2)
    for i in range(n):
        v, o, r = values[i].item(), old[i].item(), returns[i].item()
        vc = o + min(max(v - o, -0.2), 0.2)
        assert loss[i].item() == pytest.approx(0.5 * max((v - r) ** 2, (vc - r) ** 2), abs=1e-12)
        assert clipped[i].item() == (1.0 if (vc - r) ** 2 > (v - r) ** 2 else 0.0)
    assert 20 < clipped.sum() < n - 20


def test_value_loss_clipped_indicator():
    # Moved 0.5 towards the return from 0 to 0.5 (target 1): clipped to 0.2, which is worse.
    loss, clipped = value_loss(torch.tensor([0.5]), torch.tensor([0.0]), torch.tensor([1.0]), 0.2)
    assert clipped.item() == 1.0 and loss.item() == pytest.approx(0.5 * 0.8**2)
    # Moved away from the return: the unclipped error is larger, no clipping.
    loss, clipped = value_loss(torch.tensor([-0.5]), torch.tensor([0.0]), torch.tensor([1.0]), 0.2)
    assert clipped.item() == 0.0 and loss.item() == pytest.approx(0.5 * 1.5**2)


# ---------------------------------------------------------------- loss_weights


def test_loss_weights_hand_made():
    masks = [torch.tensor([0, 1, 0]), torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 0])]
    token = loss_weights(masks, "token")
    assert [w.tolist() for w in token] == [[0, 0.25, 0], [0, 0, 0.25, 0.25, 0.25], [0, 0]]
    seq = loss_weights(masks, "sequence")  # 3 completions, the third without loss tokens: each 1/3 of the mean
    assert torch.allclose(seq[0], torch.tensor([0, 1 / 3, 0]))
    assert torch.allclose(seq[1], torch.tensor([0, 0, 1 / 9, 1 / 9, 1 / 9]))
    assert torch.equal(seq[2], torch.zeros(2))
    for weights, total in ((token, 1.0), (seq, 2 / 3)):
        assert all(w.dtype == torch.float32 for w in weights)
        assert sum(w.sum().item() for w in weights) == pytest.approx(total)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_weights_random_batch(level):
    g = gen(12)
    masks = [torch.rand(int(torch.randint(1, 40, (1,), generator=g)), generator=g) < 0.6 for _ in range(9)]
    weights = loss_weights(masks, level)
    assert sum(w.sum().item() for w in weights) == pytest.approx(1.0, abs=1e-6)
    total = sum(int(m.sum()) for m in masks)
    active = sum(1 for m in masks if m.any())
    for mask, w in zip(masks, weights):
        for t in range(len(mask)):
            if not mask[t]:
                expected = 0.0
            elif level == "token":
                expected = 1 / total
            else:
                expected = 1 / (int(mask.sum()) * active)
            assert w[t].item() == pytest.approx(expected, rel=1e-6)


def test_loss_weights_empty_and_bad_level():
    for level in ("token", "sequence"):
        weights = loss_weights([torch.zeros(3), torch.zeros(2, dtype=torch.bool)], level)
        assert all(torch.equal(w, torch.zeros_like(w)) and w.dtype == torch.float32 for w in weights)
    with pytest.raises(ValueError, match="batch"):
        loss_weights([torch.ones(2)], "batch")


# ---------------------------------------------------------------- uniform_groups, masked_mean


def test_uniform_groups():
    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5 + 1e-12, 0.0, 0.0, 0.0]
    assert uniform_groups(rewards, 3) == [0, 2, 3]
    assert uniform_groups(rewards, 1) == list(range(12))
    assert uniform_groups([0.0, 1.0], 2) == []
    with pytest.raises(ValueError):
        uniform_groups(rewards, 5)


def test_masked_mean():
    values = torch.tensor([1.0, 2.0, 3.0, float("nan")])
    assert masked_mean(values, torch.tensor([1, 0, 1, 0])).item() == pytest.approx(2.0)
    assert masked_mean(values, torch.tensor([False, True, False, False])).item() == pytest.approx(2.0)
    assert masked_mean(values, torch.zeros(4)).item() == 0.0
    g = gen(13)
    x, m = randn(50, g), torch.rand(50, generator=g) < 0.5
    ref = sum(x[i].item() for i in range(50) if m[i]) / int(m.sum())
    assert masked_mean(x, m).item() == pytest.approx(ref, abs=1e-12)


# ---------------------------------------------------------------- issue 52's bugs, against the equations


def test_value_clip_fraction_counts_only_clipped_tokens():
    """Inside the clip band the clipped value is V itself: no token there counts as clipped (rebuilding it as
    old + clamp(V - old) lands a rounding step off V and counted ~2% of unclipped fp64 tokens), and the loss
    there is 0.5 (V - R)^2 exactly; outside it, verl's vf_clipfrac: the clipped error is the larger."""
    from rl2.algorithms.losses import value_loss

    generator = torch.Generator().manual_seed(0)
    old = torch.randn(20000, generator=generator, dtype=torch.float64) * 3
    values = old + torch.randn(20000, generator=generator, dtype=torch.float64) * 0.3
    returns = old + torch.randn(20000, generator=generator, dtype=torch.float64)
    clip = 0.2
    loss, clipped = value_loss(values, old, returns, clip)
    inside = (values - old).abs() <= clip
    assert inside.sum() > 5000 and clipped[inside].sum() == 0
    assert torch.equal(loss[inside], 0.5 * (values - returns)[inside] ** 2)
    verl_clipped = torch.clamp(values, old - clip, old + clip)  # verl: clip_by_value(vpreds, values ± c)
    expected = (verl_clipped - returns) ** 2 > (values - returns) ** 2
    assert torch.equal(clipped.bool(), expected) and clipped.sum() > 1000


def test_gae_advantages_are_whitened_as_rl2_does():
    """RL2's `_compute_gae` (RL2/utils/algorithms.py): advantages minus their mean over the batch's action tokens,
    over their unbiased std + eps, zero off the actions; returns raw. Written out here on a padded batch."""
    generator = torch.Generator().manual_seed(1)
    lengths = [7, 11, 5]
    masks = [(torch.rand(n, generator=generator) < 0.7).double() for n in lengths]
    for mask in masks:
        mask[-1] = 1.0
    values = [torch.randn(n, generator=generator, dtype=torch.float64) for n in lengths]
    rewards = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    advantages, returns = trajectory_advantages(rewards, torch.ones(3, dtype=torch.bool), masks, "gae", 1,
                                                gamma=0.9, lamda=0.8, values=values)
    raw = []
    for i, mask in enumerate(masks):
        token_rewards = torch.zeros(lengths[i], dtype=torch.float64)
        token_rewards[int(mask.nonzero().max())] = rewards[i]
        raw.append(gae(token_rewards, values[i], mask, 0.9, 0.8)[0])
    action = torch.cat([a[m.bool()] for a, m in zip(raw, masks)])
    eps = torch.finfo(torch.float64).eps
    for a, m, r in zip(advantages, masks, raw):
        torch.testing.assert_close(a, (r - action.mean()) * m / (action.std() + eps), rtol=0, atol=1e-12)
    whitened = torch.cat([a[m.bool()] for a, m in zip(advantages, masks)])
    assert abs(whitened.mean().item()) < 1e-12 and abs(whitened.std().item() - 1) < 1e-9
    for r, v, m, ret in zip(raw, values, masks, returns):  # returns stay advantage + value, unwhitened
        torch.testing.assert_close(ret[m.bool()], (r + v)[m.bool()], rtol=0, atol=1e-12)


def test_rl2s_tis_coef_alone_means_token_tis():
    """RL2's `actor.tis_coef=2.0`, given alone (rollout_correction left at its default, auto), is token-level TIS
    at 2.0, as in RL2; it is refused only beside another correction."""
    from rl2.algorithms.off_policy import rollout_correction
    from rl2.config import ConfigError, load_config
    from rl2.config_checks import check_off_policy_config

    config = load_config(["actor.tis_coef=2.0"])
    check_off_policy_config(config)
    correction = rollout_correction(config.actor, config.rollout)
    assert (correction.mode, correction.threshold) == ("tis", 2.0)
    with pytest.raises(ConfigError, match="give one of them"):
        check_off_policy_config(load_config(["actor.tis_coef=2.0", "actor.rollout_correction=icepop"]))


def test_loss_aggregations_are_the_peers_formulas():
    """Each `actor.loss_agg` against the peers' formulas written out on a padded batch (fp64): verl's
    `agg_loss` token-mean, seq-mean-token-mean, seq-mean-token-sum, and TRL's grpo and dr_grpo = Dr. GRPO's
    constant normaliser (sum over the batch / (batch size x max_completion_length)); `loss_level`'s names are
    aliases. The sequence means divide by every completion of the batch, also those whose loss mask is all 0
    (overlong-filtered, left out, rejected): they add 0 to the sum and 1 to the count, as in verl and TRL."""
    generator = torch.Generator().manual_seed(3)
    lengths, max_len = [5, 9, 3, 7], 12
    masks = [(torch.rand(n, generator=generator) < 0.8).double() for n in lengths]
    masks[2] = torch.zeros(3, dtype=torch.float64)  # e.g. truncated with overlong filtering: still a completion
    losses = [torch.randn(n, generator=generator, dtype=torch.float64) for n in lengths]
    padded_loss = torch.zeros(4, max_len, dtype=torch.float64)
    padded_mask = torch.zeros(4, max_len, dtype=torch.float64)
    for i, (loss, mask) in enumerate(zip(losses, masks)):
        padded_loss[i, :len(loss)], padded_mask[i, :len(mask)] = loss, mask
    batch_size = padded_mask.shape[0]
    per_sequence_sum = (padded_loss * padded_mask).sum(-1)
    expected = {
        "token_mean": (padded_loss * padded_mask).sum() / padded_mask.sum(),
        # TRL grpo: ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean(); verl: / (mask.sum(-1) + 1e-8)
        "seq_mean_token_mean": (per_sequence_sum / padded_mask.sum(-1).clamp(min=1)).mean(),
        "seq_mean_token_sum": per_sequence_sum.mean(),
        "seq_mean_token_sum_norm": (padded_loss * padded_mask).sum() / (batch_size * max_len),
    }
    for mode, value in expected.items():
        weights = loss_weights(masks, mode, norm=max_len)
        got = sum((w * loss).sum() for w, loss in zip(weights, losses))
        assert abs(got.item() - value.item()) < 1e-7, mode  # the weights are float32
    for alias, mode in (("token", "token_mean"), ("sequence", "seq_mean_token_mean")):
        assert all(torch.equal(a, b) for a, b in zip(loss_weights(masks, alias), loss_weights(masks, mode)))
    with pytest.raises(ValueError, match="positive constant"):
        loss_weights(masks, "seq_mean_token_sum_norm")


def test_metric_weights_sum_to_one_whatever_the_aggregation():
    """A minibatch's metrics (entropy, clip ratio) are weighted means under every aggregation: the loss
    weights scaled to sum to 1 (Dr. GRPO's sum over a constant or a minibatch with a masked completion would
    otherwise report a fraction of the entropy)."""
    from rl2.algorithms.losses import with_loss_weights

    masks = [torch.tensor([0.0, 1, 1, 1]), torch.zeros(3), torch.tensor([0.0, 0, 1, 1, 1, 1])]
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        weighted = with_loss_weights([{"loss_mask": m} for m in masks], mode, norm=16)
        assert abs(sum(float(s["metric_weight"].sum()) for s in weighted) - 1.0) < 1e-6, mode
        entropy = sum(float((s["metric_weight"] * 2.5 * s["loss_mask"]).sum()) for s in weighted)
        assert abs(entropy - 2.5) < 1e-6, mode  # a constant's mean is the constant
    assert float(with_loss_weights([{"loss_mask": m} for m in masks], "seq_mean_token_mean")[0]["loss_weight"].sum()) \
        == pytest.approx(1 / 3)  # 1 of 3 completions, the masked one counted


def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's `masked_whiten` (verl/utils/torch_functional.py), written out: unbiased masked variance."""
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def padded(values: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(values), width, dtype=torch.float64)
    for i, v in enumerate(values):
        out[i, :len(v)] = v
    return out


def test_rloo_and_reinforce_plus_plus_are_verls():
    """RLOO, REINFORCE++-baseline and REINFORCE++ (gamma 0.9) on single-turn responses, against verl's
    `compute_rloo_outcome_advantage`, `compute_reinforce_plus_plus_baseline_outcome_advantage` and
    `compute_reinforce_plus_plus_outcome_advantage` written out (fp64, groups of 4, one response invalid)."""
    generator = torch.Generator().manual_seed(4)
    lengths = [int(n) for n in torch.randint(2, 9, (8,), generator=generator)]
    masks = [torch.ones(n, dtype=torch.float64) for n in lengths]
    rewards = torch.rand(8, generator=generator, dtype=torch.float64)
    valid = torch.ones(8, dtype=torch.bool)
    valid[5] = False
    rewards[5] = 0.0
    mask2d = padded(masks, 8)

    rloo, _ = trajectory_advantages(rewards, valid, masks, "rloo", 4)
    for g in range(2):
        members = [i for i in range(4 * g, 4 * g + 4) if valid[i]]
        n, mean = len(members), rewards[members].mean()
        for i in members:  # verl: r n/(n-1) - mean n/(n-1)
            torch.testing.assert_close(rloo[i], (rewards[i] * n / (n - 1) - mean * n / (n - 1)) * masks[i])
    assert rloo[5].abs().sum() == 0

    baseline, _ = trajectory_advantages(rewards, valid, masks, "reinforce_plus_plus_baseline", 4)
    centred = rewards.clone()
    for g in range(2):
        members = [i for i in range(4 * g, 4 * g + 4) if valid[i]]
        centred[members] -= rewards[members].mean()
    centred[~valid] = 0
    expected = verl_masked_whiten(centred[:, None] * mask2d, mask2d) * mask2d
    torch.testing.assert_close(padded(baseline, 8), expected, rtol=0, atol=1e-10)

    plus_plus, _ = trajectory_advantages(rewards, valid, masks, "reinforce_plus_plus", 4, gamma=0.9)
    token_rewards = torch.zeros(8, 8, dtype=torch.float64)
    for i, n in enumerate(lengths):
        token_rewards[i, n - 1] = rewards[i] if valid[i] else 0.0
    returns, running = torch.zeros_like(token_rewards), torch.zeros(8, dtype=torch.float64)
    for t in reversed(range(8)):  # verl's loop
        running = token_rewards[:, t] + 0.9 * running
        returns[:, t] = running
        running = running * mask2d[:, t]
    expected = verl_masked_whiten(returns, mask2d) * mask2d
    torch.testing.assert_close(padded(plus_plus, 8), expected, rtol=0, atol=1e-10)


def test_dual_clip_bounds_negative_advantages():
    """verl's dual-clip: with A < 0 the loss is min(max(-rA, -clip(r)A), -c A); A >= 0 as plain PPO."""
    generator = torch.Generator().manual_seed(5)
    logps = torch.randn(5000, generator=generator, dtype=torch.float64)
    old = logps + torch.randn(5000, generator=generator, dtype=torch.float64) * 1.5
    advantages = torch.randn(5000, generator=generator, dtype=torch.float64)
    loss, clipped = policy_loss(logps, old, advantages, 0.2, 0.28, clip_c=3.0)
    ratio = (logps - old).exp()
    losses1, losses2 = -advantages * ratio, -advantages * ratio.clamp(0.8, 1.28)
    clip_losses1 = torch.maximum(losses1, losses2)
    expected = torch.where(advantages < 0, torch.minimum(-advantages * 3.0, clip_losses1), clip_losses1)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    dual = (advantages < 0) & (-advantages * 3.0 < clip_losses1)
    assert dual.sum() > 50 and clipped[dual].eq(1).all()
    plain, _ = policy_loss(logps, old, advantages, 0.2, 0.28)
    assert torch.equal(loss[~dual], plain[~dual])


def test_clamped_k3_is_verls_low_var_kl():
    """kl.clamp: verl's `low_var_kl`: kl = ref - logp clamped to +-20, exp(kl) - kl - 1 clamped to [-10, 10]."""
    logps = torch.tensor([-1.0, -30.0, 0.0, -0.5, -9.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, 0.0, -25.0, -0.4, -1.0], dtype=torch.float64)
    kl = (ref - logps).clamp(-20, 20)
    expected = (kl.exp() - kl - 1).clamp(-10, 10)
    torch.testing.assert_close(kl_penalty(logps, ref, "k3", clamp=True), expected, rtol=0, atol=1e-12)
    unclamped = kl_penalty(logps, ref, "k3")
    assert unclamped[1] > 1e10 and kl_penalty(logps, ref, "k3", clamp=True)[1] == 10.0
    torch.testing.assert_close(unclamped[[0, 3]], expected[[0, 3]], rtol=0, atol=1e-12)


def test_turn_discount_scales_each_sequence_by_its_distance_from_the_last():
    """adv.turn_discount: in a trajectory of K sequences the k-th trains on the trajectory's advantage times
    discount^(K-1-k); a one-sequence trajectory, and the trainer without the key, are unchanged; GAE refuses it."""
    from rl2.algorithms.advantages import turn_discounts
    from rl2.algorithms.sequences import turn_start_mask
    from rl2.config import ConfigError, load_config
    from rl2.config_checks import check_rl_config
    from rl2.rollout.trajectory import Trajectory
    from rl2.trainer.ppo_stages import add_advantages
    from rl2.trainer.step_plan import StepPlan

    starts = turn_start_mask([0, 3, 7], 10)
    assert turn_discounts(starts, 0.5).tolist() == [0.25] * 3 + [0.5] * 4 + [1.0] * 3
    assert turn_discounts(turn_start_mask([4], 6), 0.9).tolist() == pytest.approx([0.9] * 4 + [1.0] * 2)

    def advantages(discount: float) -> list[torch.Tensor]:
        config = load_config(["adv.estimator=reinforce", "data.responses_per_prompt=2", f"adv.turn_discount={discount}"])
        plan = StepPlan.from_config(config, train_max_new_tokens=8)
        masks = [torch.tensor([0, 1, 1, 0, 1, 1, 0, 1, 1, 1.0]), torch.tensor([0, 1, 1, 1.0])]
        sequences = [{"loss_mask": masks[0], "turn_starts": starts}, {"loss_mask": masks[1]}]
        trajectories = [Trajectory(messages=[], answer=None, group=0, token_ids=[], action_mask=[], logprobs=[], reward=r)
                        for r in (1.0, 0.0)]
        add_advantages(sequences, trajectories, plan, step=1)
        return [s["advantages"] for s in sequences]

    plain, discounted = advantages(1.0), advantages(0.5)
    torch.testing.assert_close(discounted[0], plain[0] * turn_discounts(starts, 0.5))
    torch.testing.assert_close(discounted[1], plain[1])
    assert plain[0][-1] == 0.5 and discounted[0][1] == 0.125
    with pytest.raises(ConfigError, match="adv.gamma"):
        check_rl_config(load_config(["adv.estimator=gae", "adv.turn_discount=0.9"]))
