"""The divisions Kafila is compared against, given the same ring order and head (the anchor).

- uniform (GPipe): every member the same number of blocks, the first k mod m one more.
- memory-proportional (exo): shares proportional to each member's memory (working set).
Both go through the same admission check as Kafila's own division.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def uniform_counts(k: int, m: int) -> tuple[int, ...]:
    base, extra = divmod(k, m)
    return tuple(base + (1 if i < extra else 0) for i in range(m))


def proportional_counts(k: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Largest-remainder shares of k blocks, at least one each (every member is used)."""
    m, total = len(weights), float(sum(weights))
    if m > k:
        raise ValueError(f"{m} members but only {k} blocks")
    if total <= 0:
        return uniform_counts(k, m)
    exact = [k * w / total for w in weights]
    counts = [max(1, math.floor(x)) for x in exact]
    by_remainder = sorted(range(m), key=lambda i: (counts[i] - exact[i], i))
    while sum(counts) < k:
        i = by_remainder.pop(0) if by_remainder else counts.index(min(counts))
        counts[i] += 1
    while sum(counts) > k:  # only when max(1, .) lifted a share; never below one
        i = max((j for j in range(m) if counts[j] > 1), key=lambda j: (counts[j] - exact[j], counts[j]))
        counts[i] -= 1
    return tuple(counts)
