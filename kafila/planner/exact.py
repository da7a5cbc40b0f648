"""The exact best integer division, by dynamic programming: a check on PARTITION, not used by it.

A stage's cost depends only on how many blocks its device holds and whether it is the head
(fixed(i, head) + n * per(i), 1 <= n <= lim(i, head)), never on where the device sits in the chain,
so the best division for a given head is the best assignment of block counts. For each head the
table best[j][s] (the smallest bottleneck of devices 0..j holding s blocks in all) is filled over
every count of device j: O(m * k^2) per head, O(m^2 * k^2) over all heads (5 devices, 64 blocks:
about 100k steps). It shares nothing with Algorithm 1 (no candidates, no binary search, no greedy
pass), so the benchmark and tests use it to check that PARTITION plus head placement is optimal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kafila.planner.cost import DeviceCost


@dataclass(frozen=True)
class Exact:
    head: int  # index of the head in `costs`
    counts: tuple[int, ...]  # blocks per device, in the order of `costs`
    bottleneck: float


def exact_for_head(k: int, costs: Sequence[DeviceCost], head: int) -> Exact | None:
    """The smallest bottleneck over every division of k blocks with `head` as head (None: none fits)."""
    m = len(costs)
    best = [0.0] + [math.inf] * k  # best[s]: devices so far holding s blocks
    choice: list[list[int]] = []
    for i, c in enumerate(costs):
        is_head = i == head
        nxt, pick = [math.inf] * (k + 1), [0] * (k + 1)
        for s in range(1, k + 1):
            for n in range(1, min(c.lim(is_head), s) + 1):
                tau = max(best[s - n], c.stage_s(n, is_head))
                if tau < nxt[s]:
                    nxt[s], pick[s] = tau, n
        best = nxt
        choice.append(pick)
    if best[k] == math.inf:
        return None
    counts, s = [0] * m, k
    for i in reversed(range(m)):
        counts[i] = choice[i][s]
        s -= counts[i]
    return Exact(head, tuple(counts), best[k])


def exact_division(k: int, costs: Sequence[DeviceCost]) -> Exact | None:
    """The best division over every head choice (every rotation of the ring), or None."""
    found = [e for h in range(len(costs)) if (e := exact_for_head(k, costs, h)) is not None]
    return min(found, key=lambda e: e.bottleneck, default=None)
