"""DAPO's overlong reward shaping (Yu et al. 2025, eq. 13): a response that runs into its length limit
loses reward gradually over the last tokens before it, instead of being cut off at full reward."""


def overlong_penalty(length: int, max_length: int, buffer: int) -> float:
    """The soft overlong punishment of a response of `length` generated tokens with limit `max_length`
    (L_max) and buffer `buffer` (L_cache): 0 up to L_max - L_cache, then ((L_max - L_cache) - length) /
    L_cache down to -1 at L_max, and -1 beyond it; 0 when `buffer` is 0 (off)."""
    if buffer <= 0:
        return 0.0
    start = max_length - buffer
    if length <= start:
        return 0.0
    return max((start - length) / buffer, -1.0)
