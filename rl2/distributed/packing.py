"""Sequence packing: spread a global batch over data-parallel ranks and padding-free micro-batches.

Every rank must run the same number of micro-batches (FSDP collectives have to line up), each
micro-batch is one row of concatenated sequences under a token cap, and ranks should carry nearly
equal token totals. `plan_micro_batches` decides which sequence goes where (`plan_grouped_micro_batches`
keeps groups such as preference pairs together), `pack_micro_batch` builds a row, `unpack_row`
splits a per-token output of that row back into sequences.
"""

import heapq
from operator import itemgetter

import numpy as np
import torch

# A partial partition is a list of subsets (sum, indices) sorted by sum, largest first. It stands
# for k subsets: any beyond the listed ones are empty.
_Subset = tuple[int, list[int]]
_by_sum = itemgetter(0)

# Swap partners considered per sequence when rebalancing ranks; see _best_exchange.
_SWAP_WINDOW = 8


def _check_lengths(lengths: list[int]) -> None:
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"sequence {i} has negative length {length}")


def _spread(part: list[_Subset], k: int) -> int:
    return part[0][0] - (part[-1][0] if len(part) == k else 0)


def _combine(a: list[_Subset], b: list[_Subset], k: int) -> list[_Subset]:
    """Join a's largest subset with b's smallest, a's 2nd largest with b's 2nd smallest, ..."""
    # a[i] meets b[k - 1 - i], which is one of b's implicit empty subsets while k - 1 - i >= len(b).
    split = max(0, k - len(b))
    out = a[:split]
    for i in range(split, len(a)):
        sum_a, items_a = a[i]
        sum_b, items_b = b[k - 1 - i]
        if len(items_a) < len(items_b):
            items_a, items_b = items_b, items_a
        items_a.extend(items_b)  # both inputs are consumed, so grow the longer list in place
        out.append((sum_a + sum_b, items_a))
    out.extend(b[: max(0, min(len(b), k - len(a)))])  # b's largest meet a's empty subsets
    out.sort(key=_by_sum, reverse=True)  # stable, so equal sums keep a deterministic order
    return out


def _largest_differencing(parts: list[list[_Subset]], k: int) -> list[_Subset]:
    """Merge partial partitions until one is left, always the two with the largest spread first.

    Karmarkar & Karp (1982), "The differencing method of set partitioning"; k-way form as in
    Michiels et al. (2012), "Performance ratios of the Karmarkar-Karp differencing method".
    Ties go to the partition created first.
    """
    heap = [(-_spread(p, k), n, p) for n, p in enumerate(parts)]
    heapq.heapify(heap)
    created = len(parts)
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]
        b = heapq.heappop(heap)[2]
        merged = _combine(a, b, k)
        heapq.heappush(heap, (-_spread(merged, k), created, merged))
        created += 1
    return heap[0][2]


def balanced_partition(lengths: list[int], k: int) -> list[list[int]]:
    """Split indices of `lengths` into k groups with nearly equal sums (Karmarkar-Karp LDM).

    Every index appears exactly once; groups come largest sum first, each sorted ascending, and
    some are empty when there are fewer than k items. Deterministic.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    _check_lengths(lengths)
    if not lengths:
        return [[] for _ in range(k)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    final = _largest_differencing([[(lengths[i], [i])] for i in order], k)
    return [sorted(items) for _, items in final] + [[] for _ in range(k - len(final))]


def _equal_count_partition(sizes: list[int], k: int) -> list[list[int]]:
    """Like `balanced_partition`, but group sizes differ by at most one (balanced LDM).

    Sorted items are cut into tuples of k consecutive ones, each tuple a partial partition with
    one item per subset, then merged with LDM (Michiels et al. 2012, "BLDM"); merging pairs up
    whole subsets, so every subset gains one item per tuple.
    """
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    parts = []
    for start in range(0, len(order), k):
        chunk = [(sizes[i], [i]) for i in order[start : start + k]]
        parts.append(chunk + [(0, []) for _ in range(k - len(chunk))])
    if not parts:
        return [[] for _ in range(k)]
    return [items for _, items in _largest_differencing(parts, k)]


def _fill_lightest(
    lengths: list[int], order: list[int], n_bins: int, cap: int
) -> list[list[int]] | None:
    """Largest first into the currently lightest bin (LPT); None if something does not fit."""
    heap = [(0, 0, b) for b in range(n_bins)]  # (tokens, count, bin): empty bins are taken first
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in order:
        tokens, count, b = heap[0]
        if tokens + lengths[i] > cap:
            return None
        bins[b].append(i)
        heapq.heapreplace(heap, (tokens + lengths[i], count + 1, b))
    return bins


def _first_fit(
    lengths: list[int], order: list[int], cap: int, max_bins: int | None = None
) -> list[list[int]] | None:
    """First fit decreasing: largest first into the first bin with room, opening bins as needed;
    None once more than `max_bins` would be needed."""
    free = np.empty(len(order), dtype=np.int64)  # never more bins than items
    bins: list[list[int]] = []
    for i in order:
        length = lengths[i]
        b = len(bins)
        # Over half the cap, a sequence fits beside none of the (longer) ones already placed.
        if 2 * length <= cap and bins:
            fits = free[: len(bins)] >= length
            first = int(fits.argmax())
            if fits[first]:
                b = first
        if b == len(bins):
            if b == max_bins:
                return None
            bins.append([])
            free[b] = cap
        free[b] -= length
        bins[b].append(i)
    return bins


def _fill_empty_bins(bins: list[list[int]]) -> None:
    """Give each empty bin the smallest item of the most crowded bin (bins list largest first)."""
    for empty in [b for b, items in enumerate(bins) if not items]:
        donor = max(range(len(bins)), key=lambda b: (len(bins[b]), -b))
        if len(bins[donor]) < 2:
            return
        bins[empty].append(bins[donor].pop())


def _best_exchange(
    lengths: np.ndarray,
    mine: np.ndarray,
    theirs: np.ndarray,
    seq_bin: np.ndarray,
    bin_tokens: np.ndarray,
    bin_count: np.ndarray,
    their_bins: np.ndarray,
    gap: int,
    cap: int,
    allow_empty: bool,
) -> tuple[int, int, int] | None:
    """Best move or swap of tokens from the heavier rank (mine) to the lighter one (theirs).

    Looks for a shift d in (0, gap) as close to gap / 2 as possible under the token cap. Returns
    (sequence leaving mine, sequence coming back or -1 for a plain move, destination bin), or None.
    """
    best, best_score = None, 0
    my_len = lengths[mine]
    if len(theirs):
        # Swaps: for each of mine, only the partners whose lengths sit nearest to L - gap / 2 (a
        # window in sorted order), which keeps this O(len(mine) * window) instead of quadratic.
        by_len = theirs[np.argsort(lengths[theirs], kind="stable")]
        sorted_len = lengths[by_len]
        lo = np.searchsorted(sorted_len, my_len - gap, side="right")[:, None]
        hi = np.searchsorted(sorted_len, my_len, side="left")[:, None]
        mid = np.searchsorted(sorted_len, my_len - gap // 2)[:, None]
        pos = mid + np.arange(-_SWAP_WINDOW, _SWAP_WINDOW)
        partner = by_len[np.clip(pos, 0, len(by_len) - 1)]
        d = my_len[:, None] - lengths[partner]
        ok = (pos >= lo) & (pos < hi) & (bin_tokens[seq_bin[partner]] + d <= cap)
        score = np.where(ok, np.minimum(d, gap - d), 0)
        flat = int(np.argmax(score))
        if score.flat[flat] > best_score:
            best_score = int(score.flat[flat])
            s, w = divmod(flat, score.shape[1])
            t = int(partner[s, w])
            best = (int(mine[s]), t, int(seq_bin[t]))
    # Moves: into the lighter rank's emptiest micro-batch; if that one has no room, none has.
    dest = int(their_bins[np.argmin(bin_tokens[their_bins])])
    ok = (my_len > 0) & (my_len < gap) & (bin_tokens[dest] + my_len <= cap)
    if not allow_empty:
        ok &= bin_count[seq_bin[mine]] >= 2
    score = np.where(ok, np.minimum(my_len, gap - my_len), 0)
    s = int(np.argmax(score))
    if score[s] > best_score:
        best = (int(mine[s]), -1, dest)
    return best


def _rebalance(
    lengths: list[int], bins: list[list[int]], ranks: list[list[int]], cap: int, max_rounds: int
) -> list[list[int]]:
    """Move or swap sequences out of the heaviest rank while that lowers it; returns new bins."""
    n, n_bins, dp = len(lengths), len(bins), len(ranks)
    if n == 0 or dp == 1:
        return bins
    length = np.asarray(lengths, dtype=np.int64)
    seq_bin = np.empty(n, dtype=np.int64)
    for b, items in enumerate(bins):
        seq_bin[items] = b
    bin_rank = np.empty(n_bins, dtype=np.int64)
    for r, owned in enumerate(ranks):
        bin_rank[owned] = r
    bin_tokens = np.bincount(seq_bin, weights=length, minlength=n_bins).astype(np.int64)
    bin_count = np.bincount(seq_bin, minlength=n_bins)
    rank_tokens = np.bincount(bin_rank, weights=bin_tokens, minlength=dp).astype(np.int64)
    rank_bins = [np.asarray(owned, dtype=np.int64) for owned in ranks]
    ideal = -(-int(length.sum()) // dp)
    allow_empty = n < n_bins

    for _ in range(max_rounds):
        heavy = int(np.argmax(rank_tokens))
        if rank_tokens[heavy] <= ideal:
            break
        seq_rank = bin_rank[seq_bin]
        mine = np.flatnonzero(seq_rank == heavy)
        found = None
        for light in np.argsort(rank_tokens, kind="stable"):
            gap = int(rank_tokens[heavy] - rank_tokens[light])
            if gap <= 1:
                break
            theirs = np.flatnonzero(seq_rank == light)
            found = _best_exchange(
                length, mine, theirs, seq_bin, bin_tokens, bin_count, rank_bins[light],
                gap, cap, allow_empty,
            )
            if found is not None:
                break
        if found is None:
            break
        s, t, dest = found
        src = int(seq_bin[s])
        shift = int(length[s] - (length[t] if t >= 0 else 0))
        seq_bin[s] = dest
        if t >= 0:
            seq_bin[t] = src
        else:
            bin_count[src] -= 1
            bin_count[dest] += 1
        bin_tokens[src] -= shift
        bin_tokens[dest] += shift
        rank_tokens[heavy] -= shift
        rank_tokens[light] += shift

    new_bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i, b in enumerate(seq_bin.tolist()):
        new_bins[b].append(i)
    return new_bins


def _padded(bins: list[list[int]], n_bins: int) -> list[list[int]]:
    """`bins` plus empty ones up to n_bins, then as few of them left empty as possible."""
    bins = bins + [[] for _ in range(n_bins - len(bins))]
    _fill_empty_bins(bins)
    return bins


def _by_tokens(lengths: list[int], bins: list[list[int]], dp: int) -> list[list[int]]:
    """Deal bins to dp ranks, the same number each, with nearly equal rank totals."""
    return _equal_count_partition([sum(lengths[i] for i in b) for b in bins], dp)


def _first_fit_per_rank(
    lengths: list[int], dp: int, cap: int, max_bins: int
) -> list[list[list[int]]] | None:
    """Karmarkar-Karp into dp ranks ignoring the cap, then first fit decreasing within each rank;
    None if some rank needs more than max_bins bins."""
    by_rank = []
    for group in balanced_partition(lengths, dp):
        own = _first_fit(lengths, sorted(group, key=lambda i: (-lengths[i], i)), cap, max_bins)
        if own is None:
            return None
        by_rank.append(own)
    return by_rank


def _pack(lengths: list[int], dp: int, cap: int) -> tuple[list[list[int]], list[list[int]]]:
    """Bins under the cap, dp * M of them with M as small as the packers here manage, and the M
    bins each rank gets."""
    # Tokens alone need ceil(total / (dp * cap)) micro-batches per rank; sequences over half the
    # cap cannot share a micro-batch, so they need one each.
    n_big = sum(2 * length > cap for length in lengths)
    per_rank = max(1, -(-sum(lengths) // (dp * cap)), -(-n_big // dp))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))

    # Filling the lightest bin gives even micro-batches, so it goes first.
    bins = _fill_lightest(lengths, order, dp * per_rank, cap)
    if bins is not None:
        return bins, _by_tokens(lengths, bins, dp)
    # First fit decreasing packs tighter; if it misses the bound too, Karmarkar-Karp into ranks
    # followed by first fit decreasing within each rank sometimes needs fewer micro-batches.
    packed = _first_fit(lengths, order, cap)
    assert packed is not None
    if len(packed) <= dp * per_rank:
        bins = _padded(packed, dp * per_rank)
        return bins, _by_tokens(lengths, bins, dp)
    per_rank = -(-len(packed) // dp)
    by_rank = _first_fit_per_rank(lengths, dp, cap, per_rank - 1) if dp > 1 else None
    if by_rank is not None:
        per_rank = max(map(len, by_rank))
        bins = [own[j] if j < len(own) else [] for own in by_rank for j in range(per_rank)]
        _fill_empty_bins(bins)
        return bins, [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(dp)]
    bins = _fill_lightest(lengths, order, dp * per_rank, cap) or _padded(packed, dp * per_rank)
    return bins, _by_tokens(lengths, bins, dp)


def plan_micro_batches(lengths: list[int], dp_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Assign sequences to data-parallel ranks and, within each rank, to micro-batches.

    Returns, per rank, a list of micro-batches (ascending indices into `lengths`). Every index
    appears exactly once, every rank gets the same number of micro-batches (as few as the packing
    finds), no micro-batch holds more than `max_tokens` tokens, and rank token totals are nearly
    equal. A micro-batch is empty only when there are fewer sequences than micro-batches. Within
    a rank, micro-batches come largest first. Deterministic.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    _check_lengths(lengths)
    for i, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(
                f"sequence {i} has {length} tokens, more than max_tokens={max_tokens}"
            )

    bins, ranks = _pack(lengths, dp_size, max_tokens)
    # Each round settles one pair of ranks; a few per rank is plenty in practice and bounds time.
    bins = _rebalance(lengths, bins, ranks, max_tokens, max_rounds=4 * dp_size + 32)

    plan = []
    for owned in ranks:
        micro = [sorted(bins[b]) for b in owned]
        micro.sort(key=lambda mb: (-sum(lengths[i] for i in mb), mb[0] if mb else len(lengths)))
        plan.append(micro)
    return plan


def plan_grouped_micro_batches(
    lengths: list[int], group_size: int, dp_size: int, max_tokens: int
) -> list[list[list[int]]]:
    """`plan_micro_batches` for sequences that come in groups: each run of `group_size` consecutive
    sequences (a preference pair: chosen, rejected) is placed as one unit, so a group lands whole
    in one micro-batch, its sequences adjacent and in order. Returns sequence indices."""
    if group_size < 1 or len(lengths) % group_size:
        raise ValueError(f"{len(lengths)} sequences do not form groups of {group_size}")
    group_lengths = [sum(lengths[start : start + group_size]) for start in range(0, len(lengths), group_size)]
    for group, length in enumerate(group_lengths):
        if group_size > 1 and length > max_tokens:
            raise ValueError(
                f"group {group} (sequences {group * group_size}-{group * group_size + group_size - 1}) has {length} "
                f"tokens, more than max_tokens={max_tokens}; its sequences must share a micro-batch"
            )
    return [
        [[group * group_size + j for group in micro for j in range(group_size)] for micro in rank_plan]
        for rank_plan in plan_micro_batches(group_lengths, dp_size, max_tokens)
    ]


def pack_micro_batch(sequences: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate sequences into one padding-free row.

    Each input maps the same keys to 1-D tensors of one length. Returns every key as [1, T], plus
    `position_ids` [1, T] (long, restarting at 0 per sequence) and `cu_seqlens` [n + 1] (int32,
    cumulative lengths from 0), as variable-length attention kernels expect.
    """
    if not sequences:
        raise ValueError("cannot pack an empty list of sequences")
    keys = list(sequences[0])
    if not keys:
        raise ValueError("sequences have no tensors")
    for reserved in ("position_ids", "cu_seqlens"):
        if reserved in keys:
            raise ValueError(f"sequences must not contain '{reserved}', it is computed here")
    seq_lens = []
    for n, seq in enumerate(sequences):
        if list(seq) != keys:
            raise ValueError(f"sequence {n} has keys {list(seq)}, expected {keys}")
        shapes = {k: tuple(v.shape) for k, v in seq.items()}
        if any(len(s) != 1 for s in shapes.values()) or len(set(shapes.values())) != 1:
            raise ValueError(f"sequence {n} needs 1-D tensors of one length, got {shapes}")
        seq_lens.append(shapes[keys[0]][0])

    packed = {k: torch.cat([seq[k] for seq in sequences]).unsqueeze(0) for k in keys}
    device = packed[keys[0]].device
    packed["position_ids"] = torch.cat(
        [torch.arange(n, dtype=torch.long, device=device) for n in seq_lens]
    ).unsqueeze(0)
    bounds = torch.tensor([0] + seq_lens, dtype=torch.int32, device=device)
    packed["cu_seqlens"] = bounds.cumsum(0, dtype=torch.int32)
    return packed


def unpack_row(row: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed [1, T] or [T] row into 1-D per-sequence tensors (views, so autograd flows)."""
    if row.dim() == 2 and row.shape[0] == 1:
        row = row[0]
    if row.dim() != 1:
        raise ValueError(f"expected a [1, T] or [T] tensor, got shape {tuple(row.shape)}")
    bounds = cu_seqlens.tolist()
    valid = cu_seqlens.dim() == 1 and len(bounds) >= 1 and bounds[0] == 0
    valid = valid and bounds[-1] == row.shape[0] and all(a <= b for a, b in zip(bounds, bounds[1:]))
    if not valid:
        raise ValueError(f"cu_seqlens {bounds} do not describe a row of length {row.shape[0]}")
    return [row[start:end] for start, end in zip(bounds[:-1], bounds[1:])]
