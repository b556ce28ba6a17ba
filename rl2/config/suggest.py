"""The valid names closest to a misspelled one, for "did you mean" in error messages."""

import difflib
from collections.abc import Iterable

# How alike (difflib's ratio, 0 to 1) a valid name must be to a misspelled one to be suggested, and how
# much less alike than the closest one another may be to be suggested beside it.
CUTOFF = 0.75
WINDOW = 0.05


def closest(name: str, valid: Iterable[str], n: int = 3) -> list[str]:
    """Up to `n` names of `valid` most like `name`, the closest first: those about as close as the closest
    one (none when nothing is close)."""
    scored = []
    for candidate in dict.fromkeys(valid):
        matcher = difflib.SequenceMatcher(None, name, candidate)
        if matcher.real_quick_ratio() >= CUTOFF and matcher.quick_ratio() >= CUTOFF and matcher.ratio() >= CUTOFF:
            scored.append((matcher.ratio(), candidate))
    scored.sort(key=lambda item: -item[0])
    return [candidate for ratio, candidate in scored[:n] if ratio >= scored[0][0] - WINDOW]


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """`; did you mean X?` (or `X or Y`) naming the valid names closest to `name`; "" when none is close."""
    matches = closest(name, valid)
    return f"; did you mean {' or '.join(matches)}?" if matches else ""
