"""Pair losses (Bradley–Terry, DPO) against plain reference implementations, on random data, and
packing that keeps each pair in one micro-batch."""

import math
import random

import pytest
import torch

from rl2.distributed.packing import pack_micro_batch, plan_grouped_micro_batches
from rl2.algorithms.preference import (
    DPOLoss,
    bradley_terry_loss,
    count_pairs,
    dpo_loss,
    pair_sequences,
    pair_weights,
    preference_accuracy,
    reward_model_loss,
    with_pair_weights,
)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def test_bradley_terry_loss_matches_reference():
    generator = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(64, generator=generator) * 5, torch.randn(64, generator=generator) * 5
    loss = bradley_terry_loss(chosen.double(), rejected.double())
    expected = [-log_sigmoid(c - r) for c, r in zip(chosen.tolist(), rejected.tolist())]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("beta,label_smoothing", [(0.1, 0.0), (0.5, 0.2), (2.0, 0.05)])
def test_dpo_loss_and_gradient_match_reference(beta, label_smoothing):
    generator = torch.Generator().manual_seed(1)
    policy_chosen, policy_rejected, ref_chosen, ref_rejected = (
        (-30 * torch.rand(32, generator=generator, dtype=torch.float64)).requires_grad_() for _ in range(4)
    )
    loss, chosen_rewards, rejected_rewards = dpo_loss(
        policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, label_smoothing
    )
    expected_loss, expected_grad = [], []
    for pc, pr, rc, rr in zip(*(t.tolist() for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected))):
        h = beta * ((pc - rc) - (pr - rr))
        expected_loss.append(-(1 - label_smoothing) * log_sigmoid(h) - label_smoothing * log_sigmoid(-h))
        sigmoid = 1 / (1 + math.exp(-h))
        # d loss / d log π(chosen) = −β·[(1 − ε)(1 − σ(h)) − ε·σ(h)]
        expected_grad.append(-beta * ((1 - label_smoothing) * (1 - sigmoid) - label_smoothing * sigmoid))
    torch.testing.assert_close(loss, torch.tensor(expected_loss, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    loss.sum().backward()
    torch.testing.assert_close(policy_chosen.grad, torch.tensor(expected_grad, dtype=torch.float64))
    torch.testing.assert_close(policy_rejected.grad, -policy_chosen.grad)
    torch.testing.assert_close(chosen_rewards, beta * (policy_chosen - ref_chosen).detach())
    torch.testing.assert_close(rejected_rewards, beta * (policy_rejected - ref_rejected).detach())
    assert not chosen_rewards.requires_grad


def test_equal_policy_and_reference_give_log_two_whatever_the_smoothing():
    logps = torch.tensor([-3.0, -10.0])
    for label_smoothing in (0.0, 0.3):
        loss, _, _ = dpo_loss(logps, logps - 1, logps, logps - 1, beta=0.1, label_smoothing=label_smoothing)
        torch.testing.assert_close(loss, torch.full((2,), math.log(2)))


def test_accuracy_counts_ties_as_half():
    accuracy = preference_accuracy(torch.tensor([2.0, 1.0, 0.5]), torch.tensor([1.0, 1.0, 0.7]))
    assert accuracy.tolist() == [1.0, 0.5, 0.0]


def random_pairs(n_pairs: int, seed: int, with_ref: bool) -> tuple[list[dict], list[dict]]:
    """Pair sequences with random per-token model outputs; one pair has its responses truncated away."""
    generator = torch.Generator().manual_seed(seed)
    sequences, outputs = [], []
    for pair in range(n_pairs):
        prompt = int(torch.randint(1, 6, (1,), generator=generator))
        for _ in range(2):
            response = 0 if pair == 1 else int(torch.randint(1, 9, (1,), generator=generator))
            length = prompt + response
            seq = {
                "input_ids": torch.randint(0, 100, (length,), generator=generator),
                "loss_mask": torch.tensor([0] * prompt + [1] * response),
            }
            if with_ref:
                seq["ref_logps"] = -5 * torch.rand(length, generator=generator)
            sequences.append(seq)
            outputs.append({"scores": torch.randn(length, generator=generator),
                            "logps": -5 * torch.rand(length, generator=generator)})
    return sequences, outputs


def test_packed_reward_model_loss_matches_per_pair_reference():
    sequences, outputs = random_pairs(7, seed=2, with_ref=False)
    assert count_pairs(sequences) == 6  # pair 1 has no response tokens left: it does not count
    row = pack_micro_batch(with_pair_weights(sequences, pair_weight=1.0))
    loss, metrics = reward_model_loss({"scores": torch.cat([o["scores"] for o in outputs]).unsqueeze(0)}, row)

    expected = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0, "reward/chosen": 0.0, "reward/rejected": 0.0}
    for pair in range(7):
        if pair == 1:
            continue
        chosen = outputs[2 * pair]["scores"][-1].item()  # the reward is the last token's score
        rejected = outputs[2 * pair + 1]["scores"][-1].item()
        expected["loss"] -= log_sigmoid(chosen - rejected)
        expected["accuracy"] += float(chosen > rejected)
        expected["margin"] += chosen - rejected
        expected["reward/chosen"] += chosen
        expected["reward/rejected"] += rejected
    # float32 sums of a dozen terms against a float64 reference: ~1e-7 relative.
    assert loss.item() == pytest.approx(expected.pop("loss"), rel=1e-5)
    for key, value in expected.items():
        assert metrics[key].item() == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_packed_dpo_loss_matches_per_pair_reference(label_smoothing):
    beta = 0.3
    sequences, outputs = random_pairs(6, seed=3, with_ref=True)
    row = pack_micro_batch(with_pair_weights(sequences, pair_weight=1.0))
    logps = torch.cat([o["logps"] for o in outputs]).unsqueeze(0)
    loss, metrics = DPOLoss(beta, label_smoothing)({"logps": logps}, row)

    expected_loss = expected_accuracy = expected_margin = 0.0
    for pair in range(6):
        if pair == 1:
            continue
        sums = []
        for i in (2 * pair, 2 * pair + 1):
            mask = sequences[i]["loss_mask"].tolist()
            sums.append((
                sum(lp for lp, m in zip(outputs[i]["logps"].tolist(), mask) if m),
                sum(lp for lp, m in zip(sequences[i]["ref_logps"].tolist(), mask) if m),
            ))
        (policy_chosen, ref_chosen), (policy_rejected, ref_rejected) = sums
        h = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
        expected_loss += -(1 - label_smoothing) * log_sigmoid(h) - label_smoothing * log_sigmoid(-h)
        expected_accuracy += float(h > 0)
        expected_margin += h
    # float32 sums of tens of log-probs against a float64 reference: ~1e-6 relative.
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["accuracy"].item() == expected_accuracy
    assert metrics["margin"].item() == pytest.approx(expected_margin, rel=1e-5, abs=1e-6)


def test_placeholder_pair_contributes_nothing():
    placeholder = {"input_ids": torch.zeros(1, dtype=torch.long), "loss_mask": torch.zeros(1, dtype=torch.long),
                   "ref_logps": torch.zeros(1), "loss_weight": torch.zeros(1)}
    row = pack_micro_batch([placeholder, placeholder])
    scores = torch.randn(1, 2, requires_grad=True)
    loss, metrics = reward_model_loss({"scores": scores}, row)
    loss.backward()
    assert loss.item() == 0 and all(value.item() == 0 for value in metrics.values())
    assert scores.grad is not None and scores.grad.abs().sum() == 0
    loss, _ = DPOLoss(0.1)({"logps": torch.randn(1, 2)}, row)
    assert loss.item() == 0


def test_pair_sequences_alternate_chosen_and_rejected():
    items = [{"chosen": {"input_ids": torch.tensor([i, 1])}, "rejected": {"input_ids": torch.tensor([i, 2])}} for i in range(3)]
    assert [s["input_ids"].tolist() for s in pair_sequences(items)] == [[0, 1], [0, 2], [1, 1], [1, 2], [2, 1], [2, 2]]


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_grouped_plan_keeps_each_pair_whole_and_in_order(dp_size):
    rng = random.Random(dp_size)
    for trial in range(30):
        lengths = [rng.randint(1, 40) for _ in range(2 * rng.randint(1, 25))]
        max_tokens = max(lengths[i] + lengths[i + 1] for i in range(0, len(lengths), 2)) + rng.randint(0, 60)
        plan = plan_grouped_micro_batches(lengths, 2, dp_size, max_tokens)
        assert len(plan) == dp_size and len({len(rank) for rank in plan}) == 1
        seen = []
        for rank in plan:
            for micro in rank:
                assert sum(lengths[i] for i in micro) <= max_tokens
                assert len(micro) % 2 == 0
                for chosen, rejected in zip(micro[0::2], micro[1::2]):
                    assert chosen % 2 == 0 and rejected == chosen + 1  # a pair, adjacent, chosen first
                seen += micro
        assert sorted(seen) == list(range(len(lengths)))


def test_grouped_plan_rejects_a_pair_over_the_budget():
    with pytest.raises(ValueError, match=r"group 1 \(sequences 2-3\) has 70 tokens, more than max_tokens=64"):
        plan_grouped_micro_batches([10, 10, 30, 40], 2, 1, 64)
    with pytest.raises(ValueError, match="do not form groups of 2"):
        plan_grouped_micro_batches([10, 10, 30], 2, 1, 64)


def test_pair_weights_sum_to_one_over_the_pairs_that_count():
    sequences, _ = random_pairs(5, seed=4, with_ref=False)  # pair 1 has no response tokens
    weighted = with_pair_weights(sequences)
    row = pack_micro_batch(weighted)
    assert pair_weights(row).tolist() == pytest.approx([0.25, 0.0, 0.25, 0.25, 0.25])
    assert all(w["loss_weight"].sum() == 0 for w in weighted[1::2])  # a pair's weight sits on its chosen response
    assert all((w["loss_weight"] * (1 - w["loss_mask"])).sum() == 0 for w in weighted)  # on a loss token
