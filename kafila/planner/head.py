"""Head placement (Section V-C): PARTITION once per rotation of the ring, keep the anchor unless
another rotation's bottleneck beats it by more than a margin mu.

The ring order is fixed first; rotating it moves no edge, so which member is head is a separate
choice. The head holds the first blocks of the chain (embedding, then its blocks) and pays the
head read; its block limit is smaller because embedding and unembedding are resident.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kafila.planner.cost import DeviceCost
from kafila.planner.partition import Infeasible, Partition, partition

MU = 0.05  # a rotation must beat the anchor by more than 5% to move the head


@dataclass(frozen=True)
class HeadChoice:
    head: int  # index into the ring order
    counts: tuple[int, ...]  # blocks per device in ring order (un-rotated)
    bottleneck: float


def solve_rotation(k: int, costs: Sequence[DeviceCost], head: int) -> Partition | Infeasible:
    """PARTITION with `head` first in the chain; counts come back in rotated order."""
    m = len(costs)
    chain = [costs[(head + j) % m] for j in range(m)]
    return partition(
        k,
        [c.fixed(j == 0) for j, c in enumerate(chain)],
        [c.per_block_s for c in chain],
        [c.lim(j == 0) for j, c in enumerate(chain)],
    )


def unrotate(counts: Sequence[int], head: int) -> tuple[int, ...]:
    m = len(counts)
    return tuple(counts[(i - head) % m] for i in range(m))


def place_head(
    k: int, costs: Sequence[DeviceCost], anchor: int = 0, mu: float = MU
) -> HeadChoice | Infeasible:
    """Best rotation by achieved bottleneck; the anchor stays unless beaten by more than mu."""
    results = [solve_rotation(k, costs, r) for r in range(len(costs))]
    best: HeadChoice | None = None
    for r, res in enumerate(results):
        if isinstance(res, Partition) and (best is None or res.bottleneck < best.bottleneck):
            best = HeadChoice(r, unrotate(res.counts, r), res.bottleneck)
    if best is None:
        first = results[anchor]
        assert isinstance(first, Infeasible)
        return Infeasible(f"no member can hold the head: {first.reason}")
    kept = results[anchor]
    if isinstance(kept, Partition) and not best.bottleneck < kept.bottleneck * (1 - mu):
        return HeadChoice(anchor, unrotate(kept.counts, anchor), kept.bottleneck)
    return best
