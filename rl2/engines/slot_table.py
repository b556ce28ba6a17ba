"""Which sequence each KV slot holds, and the slot that shares the longest prefix with new tokens.

A slot is free (nothing worth keeping), active (a sequence is being generated in it) or kept (a
finished sequence whose cache the next turn of its conversation may continue). Prefixes are
indexed by a hash chain over blocks of `BLOCK` tokens, so finding the best slot for a prompt
costs one dict lookup per block, not a comparison with every slot.
"""

from dataclasses import dataclass, field

BLOCK = 16


def block_hashes(tokens: list[int]) -> list[int]:
    """hashes[k] identifies tokens[: (k + 1) * BLOCK] (whole blocks only)."""
    hashes, chain = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        chain = hash((chain, tuple(tokens[start : start + BLOCK])))
        hashes.append(chain)
    return hashes


def common_prefix_length(a: list[int], b: list[int], start: int = 0) -> int:
    """How many leading tokens `a` and `b` share, given that the first `start` are shared."""
    length = start
    limit = min(len(a), len(b))
    while length < limit and a[length] == b[length]:
        length += 1
    return length


@dataclass
class SlotTable:
    """Slot states and contents for `num_slots` slots; kept slots are reused least recently kept first."""

    num_slots: int
    contents: list[list[int] | None] = field(init=False)  # tokens whose keys/values the slot holds
    hashes: list[list[int]] = field(init=False)  # block_hashes(contents), as indexed
    active: list[bool] = field(init=False)
    kept_at: list[int] = field(init=False)  # when a kept slot was kept (-1: free or active)
    index: dict[int, set[int]] = field(init=False, default_factory=dict)  # block hash → slots with that prefix
    clock: int = field(init=False, default=0)

    def __post_init__(self):
        self.contents = [None] * self.num_slots
        self.hashes = [[] for _ in range(self.num_slots)]
        self.active = [False] * self.num_slots
        self.kept_at = [-1] * self.num_slots

    def free_slots(self) -> int:
        return self.active.count(False)

    def highest_active(self) -> int:
        """The highest active slot, or -1."""
        return max((slot for slot in range(self.num_slots) if self.active[slot]), default=-1)

    def longest_prefix(self, tokens: list[int], hashes: list[int]) -> tuple[int, int]:
        """(slot, length): a slot (active or kept) holding the longest prefix of `tokens`, whose
        `block_hashes` are `hashes`; (-1, 0) if none shares a whole block."""
        for blocks in range(len(hashes), 0, -1):
            holders = self.index.get(hashes[blocks - 1])
            if not holders:
                continue
            whole = blocks * BLOCK
            best_slot, best_length = -1, 0
            for slot in sorted(holders):
                if self.contents[slot][:whole] != tokens[:whole]:  # a hash collision
                    continue
                length = common_prefix_length(tokens, self.contents[slot], whole)
                if length > best_length:
                    best_slot, best_length = slot, length
            if best_slot >= 0:
                return best_slot, best_length
        return -1, 0

    def claim(self, preferred: int = -1) -> int:
        """An inactive slot for a new sequence: `preferred` if it is inactive, else the lowest free
        one, else the one kept longest ago. Its contents are cleared; raises if all are active."""
        if preferred >= 0 and not self.active[preferred]:
            slot = preferred
        else:
            free = [s for s in range(self.num_slots) if not self.active[s] and self.kept_at[s] < 0]
            kept = [s for s in range(self.num_slots) if not self.active[s] and self.kept_at[s] >= 0]
            if free:
                slot = free[0]
            elif kept:
                slot = min(kept, key=lambda s: self.kept_at[s])
            else:
                raise RuntimeError("no inactive KV slot to claim")
        self._set_contents(slot, None)
        self.active[slot] = True
        self.kept_at[slot] = -1
        return slot

    def start(self, slot: int, tokens: list[int]) -> None:
        """`slot` (claimed) now holds `tokens` (its prompt, once prefilled)."""
        self._set_contents(slot, tokens)

    def keep(self, slot: int, tokens: list[int]) -> None:
        """The sequence in `slot` finished; its cache holds `tokens` and stays until claimed."""
        self._set_contents(slot, tokens)
        self.active[slot] = False
        self.kept_at[slot] = self.clock
        self.clock += 1

    def clear(self) -> None:
        """Forget every kept cache (new weights, or the memory was released)."""
        for slot in range(self.num_slots):
            if not self.active[slot]:
                self._set_contents(slot, None)
                self.kept_at[slot] = -1

    def drop_active(self) -> None:
        """Free every active slot, forgetting its contents."""
        for slot in range(self.num_slots):
            if self.active[slot]:
                self._set_contents(slot, None)
                self.active[slot] = False

    def _set_contents(self, slot: int, tokens: list[int] | None) -> None:
        for hash_ in self.hashes[slot]:
            holders = self.index[hash_]
            holders.discard(slot)
            if not holders:
                del self.index[hash_]
        self.contents[slot] = tokens
        self.hashes[slot] = block_hashes(tokens) if tokens is not None else []
        for hash_ in self.hashes[slot]:
            self.index.setdefault(hash_, set()).add(slot)
