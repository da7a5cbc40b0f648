"""PARTITION (Algorithm 1 of the paper): exact chain-on-chain block placement for a fixed order.

Device i holding n blocks costs fixed(i) + n * per(i), for 1 <= n <= lim(i). The optimal
bottleneck is one of the candidate values fixed(i) + n * per(i) (line 1); the smallest feasible one
is found by binary search (line 2) with FEASIBLE, one greedy left-to-right pass that gives each
device the most blocks it can hold within the bound while reserving one block for every device
still to come (lines 7-22). Generating and sorting the candidates dominates: O(km log km).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Relative slack when turning a bound back into a block count: a candidate tau = f + n*p must give
# back n, not n - 1, despite rounding in (tau - f) / p.
_EPS = 1e-9


@dataclass(frozen=True)
class Partition:
    counts: tuple[int, ...]  # blocks per device, in the given order
    bottleneck: float  # tau*: the largest stage cost of this division


@dataclass(frozen=True)
class Infeasible:
    reason: str


def partition(
    k: int, fixed: Sequence[float], per: Sequence[float], lim: Sequence[int]
) -> Partition | Infeasible:
    """Algorithm 1. Every device gets at least one block (every admitted device is used)."""
    m = len(fixed)
    if not (m == len(per) == len(lim)) or m == 0:
        raise ValueError(f"fixed/per/lim lengths {len(fixed)}/{len(per)}/{len(lim)} must match and be > 0")
    if any(p <= 0 for p in per):
        raise ValueError(f"per-block costs must be > 0, got {list(per)}")
    if m > k:
        return Infeasible(f"{m} devices but the model has only {k} blocks; every device needs one")
    room = sum(min(k, max(0, n)) for n in lim)
    if room < k:
        return Infeasible(f"the devices hold at most {room} of {k} blocks (limits {list(lim)})")
    candidates = sorted(  # line 1
        fixed[i] + n * per[i] for i in range(m) for n in range(1, min(k, lim[i]) + 1)
    )
    lo, hi, best = 0, len(candidates) - 1, None  # line 2: smallest feasible candidate
    while lo <= hi:
        mid = (lo + hi) // 2
        counts = feasible(k, candidates[mid], fixed, per, lim)
        if counts is None:
            lo = mid + 1
        else:
            best, hi = counts, mid - 1
    if best is None:  # lines 3-4
        return Infeasible(f"no division of {k} blocks fits the devices' block limits {list(lim)}")
    tau = max(fixed[i] + n * per[i] for i, n in enumerate(best))
    return Partition(best, tau)


def feasible(
    k: int, tau: float, fixed: Sequence[float], per: Sequence[float], lim: Sequence[int]
) -> tuple[int, ...] | None:
    """FEASIBLE(k, tau): block counts with every stage within tau, or None (INFEASIBLE)."""
    m, left, counts = len(fixed), k, []
    for i in range(m):
        if fixed[i] > tau * (1 + _EPS):  # lines 10-11
            return None
        n = min(blocks_within(tau, fixed[i], per[i]), lim[i], left - (m - 1 - i))  # line 13
        if n < 1:  # lines 14-15
            return None
        counts.append(n)
        left -= n
    return tuple(counts) if left == 0 else None  # lines 19-22


def blocks_within(tau: float, fixed: float, per: float) -> int:
    """The most blocks a device of cost fixed + n * per holds within tau (may be below 1)."""
    return math.floor((tau - fixed) / per * (1 + _EPS) + _EPS)
