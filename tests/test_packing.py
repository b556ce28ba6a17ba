import heapq
import math

import numpy as np
import pytest
import torch

from rl2.distributed.packing import (
    _equal_count_partition,
    _fill_empty_bins,
    _rebalance,
    balanced_partition,
    pack_micro_batch,
    plan_micro_batches,
    unpack_row,
)


def uniform(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1, 1025, n).tolist()


def long_tailed(rng: np.random.Generator, n: int) -> list[int]:
    return np.clip(rng.lognormal(np.log(700), 1.2, n), 1, 16384).astype(int).tolist()


def bimodal(rng: np.random.Generator, n: int) -> list[int]:
    long = rng.random(n) < 0.3
    return np.where(long, rng.integers(8000, 16385, n), rng.integers(1000, 2001, n)).tolist()


DISTRIBUTIONS = [uniform, long_tailed, bimodal]


def lpt_max(lengths: list[int], k: int) -> int:
    """Reference greedy: largest first onto the lightest group; returns the largest group sum."""
    sums = [0] * k
    heap = [(0, g) for g in range(k)]
    for length in sorted(lengths, reverse=True):
        _, g = heapq.heappop(heap)
        sums[g] += length
        heapq.heappush(heap, (sums[g], g))
    return max(sums)


def ffd_fits(lengths: list[int], n_bins: int, cap: int) -> bool:
    """Reference first fit decreasing into a fixed number of bins."""
    free = [cap] * n_bins
    for length in sorted(lengths, reverse=True):
        for b in range(n_bins):
            if length <= free[b]:
                free[b] -= length
                break
        else:
            return False
    return True


def ffd_per_rank(lengths: list[int], dp: int, cap: int) -> int:
    m = 1
    while not ffd_fits(lengths, dp * m, cap):
        m += 1
    return m


def kk_then_ffd_per_rank(lengths: list[int], dp: int, cap: int) -> int:
    """Reference: Karmarkar-Karp into ranks ignoring the cap, then FFD within each rank."""
    groups = balanced_partition(lengths, dp)
    return max(ffd_per_rank([lengths[i] for i in g], 1, cap) for g in groups)


def check_plan(plan: list[list[list[int]]], lengths: list[int], dp: int, cap: int) -> None:
    """Every invariant plan_micro_batches promises, with an independent FFD as the count bound."""
    n, total = len(lengths), sum(lengths)
    assert len(plan) == dp
    m = len(plan[0])
    assert all(len(rank) == m for rank in plan), "ranks have different micro-batch counts"
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(n))
    for rank in plan:
        tokens = [sum(lengths[i] for i in mb) for mb in rank]
        assert max(tokens) <= cap
        assert tokens == sorted(tokens, reverse=True), "micro-batches not largest first"
        assert all(mb == sorted(mb) for mb in rank)
    if n >= dp * m:
        assert all(mb for rank in plan for mb in rank), "empty micro-batch with enough sequences"
    lower = max(1, math.ceil(total / (dp * cap)))
    assert lower <= m <= min(ffd_per_rank(lengths, dp, cap), kk_then_ffd_per_rank(lengths, dp, cap))
    if lengths:
        # The heaviest rank holds at least the mean, the longest sequence, and (pigeonhole) two
        # of the dp + 1 longest. Allow half a sequence over that bound; the worst measured over
        # thousands of random cases is 0.4, mostly on tiny batches where every sequence needs
        # its own micro-batch.
        rank_tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
        top = sorted(lengths, reverse=True) + [0] * (dp + 1)
        bound = max(math.ceil(total / dp), top[0], top[dp - 1] + top[dp])
        assert max(rank_tokens) <= bound + top[0] // 2


# ---------------------------------------------------------------- balanced_partition


@pytest.mark.parametrize("k", [1, 2, 3, 8, 64])
def test_balanced_partition_is_a_partition_near_the_bound(k):
    rng = np.random.default_rng(k)
    for trial in range(60):
        dist = DISTRIBUTIONS[trial % 3]
        lengths = dist(rng, int(rng.integers(1, 300)))
        groups = balanced_partition(lengths, k)
        assert len(groups) == k
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(g == sorted(g) for g in groups)
        sums = [sum(lengths[i] for i in g) for g in groups]
        assert sums == sorted(sums, reverse=True)
        # A merge never widens the spread beyond its inputs', and each item starts as its own.
        assert max(sums) - min(sums) <= max(lengths)
        bound = max(math.ceil(sum(lengths) / k), max(lengths))
        # LDM's worst case is 4/3 - 1/(3k) of the optimum (Michiels et al. 2012).
        assert max(sums) * 3 * k <= (4 * k - 1) * bound
        if len(lengths) >= 4 * k:
            assert max(sums) <= bound + max(lengths) // 3


def test_balanced_partition_beats_greedy_overall():
    # LDM is not better than LPT on every input, but it is on the vast majority of them.
    rng = np.random.default_rng(0)
    wins = losses = 0
    for trial in range(600):
        lengths = DISTRIBUTIONS[trial % 3](rng, int(rng.integers(5, 200)))
        k = int(rng.choice([2, 3, 4, 8, 16]))
        ldm = max(sum(lengths[i] for i in g) for g in balanced_partition(lengths, k))
        lpt = lpt_max(lengths, k)
        wins += ldm < lpt
        losses += ldm > lpt
        assert ldm <= 1.05 * lpt
    assert losses <= 0.05 * 600
    assert wins >= 5 * losses


def test_balanced_partition_known_cases():
    # Greedy gives {8, 5, 4} / {7, 6} (17); differencing gives 16 / 14.
    groups = balanced_partition([8, 7, 6, 5, 4], 2)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in g) for g in groups) == [14, 16]
    assert all(len(g) == 3 for g in balanced_partition([5] * 12, 4))
    assert balanced_partition([3, 1], 4) == [[0], [1], [], []]
    assert balanced_partition([], 3) == [[], [], []]
    assert sorted(len(g) for g in balanced_partition([4, 0, 4], 2)) == [1, 2]
    lengths = long_tailed(np.random.default_rng(5), 500)
    assert balanced_partition(lengths, 8) == balanced_partition(list(lengths), 8)
    with pytest.raises(ValueError):
        balanced_partition([1, 2], 0)


def test_equal_count_partition_balances_with_equal_counts():
    rng = np.random.default_rng(1)
    for trial in range(60):
        k = int(rng.choice([2, 3, 8, 64]))
        m = int(rng.integers(1, 6))
        sizes = DISTRIBUTIONS[trial % 3](rng, k * m)
        groups = _equal_count_partition(sizes, k)
        assert sorted(i for g in groups for i in g) == list(range(k * m))
        assert all(len(g) == m for g in groups)
        sums = [sum(sizes[i] for i in g) for g in groups]
        # Each merge's spread is at most the larger of its inputs', so the result's spread is at
        # most that of the widest starting tuple (dealing round-robin would add them all up).
        ordered = sorted(sizes, reverse=True)
        widest = max(ordered[j] - ordered[j + k - 1] for j in range(0, k * m, k))
        assert max(sums) - min(sums) <= widest


# ---------------------------------------------------------------- plan_micro_batches


def test_fill_empty_bins_moves_one_item_from_crowded_bins():
    bins = [[4, 1, 0], [3], [], [2, 5], []]
    _fill_empty_bins(bins)
    assert all(bins) and sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4, 5]
    assert bins[0] == [4] and bins[2] == [0] and bins[4] == [1]


@pytest.mark.parametrize("dp", [1, 2, 3, 8, 64])
def test_plan_invariants_on_random_batches(dp):
    rng = np.random.default_rng(100 + dp)
    for trial in range(45 if dp < 64 else 15):
        dist = DISTRIBUTIONS[trial % 3]
        lengths = dist(rng, int(rng.integers(1, 40 * dp + 2)))
        longest = max(lengths)
        cap = [longest, int(1.3 * longest) + 1, 16384, 65536][trial // 3 % 4]
        cap = max(cap, longest)
        plan = plan_micro_batches(lengths, dp, cap)
        check_plan(plan, lengths, dp, cap)
        assert plan == plan_micro_batches(lengths, dp, cap), "not deterministic"


def test_plan_invariants_on_small_tight_batches():
    # Few sequences, caps near the lengths: where rebalancing could empty or overfill a batch.
    rng = np.random.default_rng(7)
    for _ in range(1500):
        dp = int(rng.integers(1, 5))
        cap = int(rng.choice([10, 16]))
        lengths = rng.integers(1, cap + 1, int(rng.integers(1, 10))).tolist()
        check_plan(plan_micro_batches(lengths, dp, cap), lengths, dp, cap)


def test_rebalance_known_case():
    # Rank 0 holds 9 tokens, rank 1 holds 20. Moving a 7 over would overflow both of rank 0's
    # micro-batches, so the balance has to come from swaps; 15 of 29 tokens is the optimum.
    lengths = [5, 4, 7, 3, 7, 3]
    bins = _rebalance(lengths, [[0], [1], [2, 5], [3, 4]], [[0, 1], [2, 3]], 10, max_rounds=10)
    tokens = [sum(lengths[i] for i in b) for b in bins]
    assert max(tokens) <= 10 and all(bins)
    assert max(tokens[0] + tokens[1], tokens[2] + tokens[3]) == 15


def test_rebalance_keeps_packings_valid_and_never_raises_the_heaviest_rank():
    # Start from deliberately bad packings: items dealt into bins in random order, first fit.
    rng = np.random.default_rng(3)
    for _ in range(400):
        dp, m, cap = int(rng.integers(2, 5)), int(rng.integers(1, 4)), int(rng.choice([10, 16]))
        lengths = rng.integers(1, cap + 1, int(rng.integers(dp * m, 4 * dp * m))).tolist()
        bins: list[list[int]] = [[] for _ in range(dp * m)]
        room = [cap] * (dp * m)
        for i in rng.permutation(len(lengths)).tolist():
            fits = [b for b in range(dp * m) if room[b] >= lengths[i]]
            if not fits:
                lengths[i] = 0  # keeps the batch packable without changing the bin count
            b = fits[int(rng.integers(len(fits)))] if fits else int(rng.integers(dp * m))
            bins[b].append(i)
            room[b] -= lengths[i]
        _fill_empty_bins(bins)
        ranks = [list(range(r * m, (r + 1) * m)) for r in range(dp)]
        before = max(sum(lengths[i] for b in owned for i in bins[b]) for owned in ranks)
        after_bins = _rebalance(lengths, [list(b) for b in bins], ranks, cap, max_rounds=100)
        assert sorted(i for b in after_bins for i in b) == list(range(len(lengths)))
        assert all(b and sum(lengths[i] for i in b) <= cap for b in after_bins)
        after = max(sum(lengths[i] for b in owned for i in after_bins[b]) for owned in ranks)
        assert after <= before


def test_plan_balances_few_sequences_per_rank():
    # 8 sequences per rank leaves little to balance with; moves alone average ~1% over the
    # bound here, moves and swaps ~0.2%.
    rng = np.random.default_rng(8)
    ratios = []
    for trial in range(60):
        lengths = DISTRIBUTIONS[trial % 3](rng, 64)
        plan = plan_micro_batches(lengths, 8, 16384)
        rank_tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
        top = sorted(lengths, reverse=True)
        ratios.append(max(rank_tokens) / max(math.ceil(sum(lengths) / 8), top[0], top[7] + top[8]))
    assert np.mean(ratios) <= 1.004


@pytest.mark.parametrize("dp, limit", [(2, 1.01), (8, 1.01), (64, 1.05)])
def test_plan_balances_ranks_and_reaches_the_lower_bound(dp, limit):
    # The benchmark's regime: 32 sequences per rank, 16k-token micro-batches.
    rng = np.random.default_rng(dp)
    for trial in range(12 if dp < 64 else 3):
        lengths = DISTRIBUTIONS[trial % 3](rng, 32 * dp)
        plan = plan_micro_batches(lengths, dp, 16384)
        check_plan(plan, lengths, dp, 16384)
        rank_tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
        assert max(rank_tokens) / (sum(rank_tokens) / dp) <= limit
        lower = max(1, math.ceil(sum(lengths) / (dp * 16384)))
        if ffd_fits(lengths, dp * lower, 16384):
            assert len(plan[0]) == lower


@pytest.mark.parametrize("dp, seed", [(2, 216), (3, 110), (4, 206)])
def test_plan_beats_first_fit_where_partitioning_ranks_first_does(dp, seed):
    # Batches found by search where first fit decreasing over everything needs one more
    # micro-batch per rank than partitioning into ranks first; the plan must take the better.
    lengths = bimodal(np.random.default_rng(seed), 32 * dp)
    better = kk_then_ffd_per_rank(lengths, dp, 16384)
    assert better < ffd_per_rank(lengths, dp, 16384)
    plan = plan_micro_batches(lengths, dp, 16384)
    check_plan(plan, lengths, dp, 16384)
    assert len(plan[0]) == better


def test_plan_edge_cases():
    assert plan_micro_batches([7], 1, 10) == [[[0]]]
    assert plan_micro_batches([7], 3, 10) == [[[0]], [[]], [[]]]
    assert plan_micro_batches([], 2, 10) == [[[]], [[]]]

    plan = plan_micro_batches([5, 9, 2], 4, 10)  # fewer sequences than ranks
    check_plan(plan, [5, 9, 2], 4, 10)
    assert sorted(len(rank[0]) for rank in plan) == [0, 1, 1, 1]

    plan = plan_micro_batches([100] * 16, 4, 200)  # all equal: 2 micro-batches of 2 per rank
    check_plan(plan, [100] * 16, 4, 200)
    assert all(len(rank) == 2 and all(len(mb) == 2 for mb in rank) for rank in plan)

    plan = plan_micro_batches([10, 10, 3, 7], 2, 10)  # sequences exactly at the cap
    check_plan(plan, [10, 10, 3, 7], 2, 10)
    assert len(plan[0]) == 2

    plan = plan_micro_batches([0, 0, 5, 0], 2, 5)  # empty sequences still land somewhere
    check_plan(plan, [0, 0, 5, 0], 2, 5)


def test_plan_errors():
    with pytest.raises(ValueError, match=r"sequence 2 has 17 tokens.*max_tokens=16"):
        plan_micro_batches([3, 16, 17, 4], 2, 16)
    with pytest.raises(ValueError):
        plan_micro_batches([1, 2], 0, 16)
    with pytest.raises(ValueError):
        plan_micro_batches([1, 2], 2, 0)
    with pytest.raises(ValueError):
        plan_micro_batches([1, -2], 2, 16)


# ---------------------------------------------------------------- pack / unpack


def make_sequences(seq_lens: list[int]) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, 1000, (n,), generator=gen),
            "loss_mask": torch.rand(n, generator=gen) > 0.5,
            "logps": torch.randn(n, generator=gen),
        }
        for n in seq_lens
    ]


def test_pack_unpack_roundtrip():
    seq_lens = [3, 1, 5, 0, 2]
    sequences = make_sequences(seq_lens)
    packed = pack_micro_batch(sequences)
    total = sum(seq_lens)
    assert set(packed) == {"input_ids", "loss_mask", "logps", "position_ids", "cu_seqlens"}
    for key in ("input_ids", "loss_mask", "logps"):
        assert packed[key].shape == (1, total)
        assert packed[key].dtype == sequences[0][key].dtype
        parts = unpack_row(packed[key], packed["cu_seqlens"])
        assert len(parts) == len(sequences)
        for part, seq in zip(parts, sequences):
            assert torch.equal(part, seq[key])
    assert packed["cu_seqlens"].dtype == torch.int32
    assert packed["cu_seqlens"].tolist() == [0, 3, 4, 9, 9, 11]
    assert packed["position_ids"].dtype == torch.long
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 1]]
    flat = unpack_row(packed["logps"][0], packed["cu_seqlens"])  # a [T] row works too
    assert [p.numel() for p in flat] == seq_lens


def test_unpack_row_passes_gradients():
    x = torch.randn(1, 10, requires_grad=True)
    parts = unpack_row(x * 2, torch.tensor([0, 4, 10], dtype=torch.int32))
    (parts[0].sum() + 3 * parts[1].sum()).backward()
    assert x.grad.tolist() == [[2.0] * 4 + [6.0] * 6]


def test_pack_and_unpack_errors():
    with pytest.raises(ValueError):
        pack_micro_batch([])
    with pytest.raises(ValueError):  # tensors of one sequence disagree in length
        pack_micro_batch([{"input_ids": torch.zeros(3), "logps": torch.zeros(4)}])
    with pytest.raises(ValueError):  # different keys across sequences
        pack_micro_batch([{"input_ids": torch.zeros(3)}, {"logps": torch.zeros(3)}])
    with pytest.raises(ValueError):
        unpack_row(torch.zeros(1, 5), torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError):
        unpack_row(torch.zeros(2, 5), torch.tensor([0, 5]))
