"""Division for the declared load: PARTITION's bottleneck, relaxed where the session's requests
cannot keep every stage busy.

With U requests in flight a ring serves at most U tokens per circuit (each request goes round
once per token; the circuit C is every stage plus every edge, equation (1)) and at most one token
per bottleneck B (the slowest stage serves every request). A token of the session's aggregate
output therefore takes

    per_token(D) = max(B(D), C(D) / U).

With at least as many requests as stages and a fast network, C / U <= B at the balanced division
and PARTITION's bottleneck is the whole objective. With fewer (one user on three members), some
stage idles whatever the division, and a block on a fast device shortens every token even where
it lengthens the slowest stage: the circuit, not the bottleneck, is what one user waits for.

Exact, given the bound: for a bound tau on every stage, the shortest circuit fills blocks greedily
onto the devices with the smallest per-block cost (a stage's cost is linear in its blocks, and
every device keeps one). For any division D, the fill at tau = B(D), one of the candidates
fixed(i) + n * per(i), has B <= B(D) and C <= C(D), so scanning the candidates upward from
PARTITION's optimum tau* finds the best. Over those bounds, max(tau, circuit(tau) / U) is the
larger of a rising and a falling function, so a binary search finds its least value; a second
one finds the tightest bound whose division comes within mu of it (the head margin, 5%): the most
even stages among divisions that good, since a predicted gain inside the probe's noise is not
worth the balance (three equal members do not put 28 of 30 blocks on one for a 0.5% shorter
circuit). O(log km) fills per head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kafila.planner.cost import DeviceCost
from kafila.planner.head import solve_rotation, unrotate
from kafila.planner.partition import Infeasible, blocks_within

_TIE = 1e-9  # relative: sums of the same stage costs in another order differ in the last bits


@dataclass(frozen=True)
class LoadChoice:
    head: int  # index into the ring order
    counts: tuple[int, ...]  # blocks per device in ring order (un-rotated)
    bottleneck_s: float
    circuit_s: float  # stages + edge latencies
    per_token_s: float  # max(bottleneck, circuit / concurrency)
    tau_star_s: float  # PARTITION's smallest bottleneck for this head (the balanced division)

    @property
    def circuit_bound(self) -> bool:
        """The division gave up some balance for a shorter circuit."""
        return self.bottleneck_s > self.tau_star_s * (1 + _TIE)


def divide_for_load(
    k: int,
    costs: Sequence[DeviceCost],
    *,
    concurrency: int,
    latency_s: float,
    heads: Sequence[int],
    anchor: int,
    mu: float,
) -> LoadChoice | Infeasible:
    """The best division over the allowed heads, within mu of the best time per token with the most
    even stages; the anchor stays head unless beaten by more than mu."""
    if concurrency < 1:
        raise ValueError(f"concurrency {concurrency} must be >= 1")
    found: dict[int, LoadChoice] = {}
    first: Infeasible | None = None
    for r in heads:
        got = _for_head(k, costs, r, concurrency, latency_s, mu)
        if isinstance(got, Infeasible):
            first = first or got
        else:
            found[r] = got
    if not found:
        assert first is not None
        return first
    best = _best(found.values())
    kept = found.get(anchor)
    if kept is not None and not best.per_token_s < kept.per_token_s * (1 - mu):
        return kept
    return best


def _better(a: LoadChoice, b: LoadChoice) -> bool:
    """a before b: shorter per-token time, then shorter circuit, then smaller bottleneck."""
    for x, y in ((a.per_token_s, b.per_token_s), (a.circuit_s, b.circuit_s)):
        if abs(x - y) > _TIE * max(abs(x), abs(y)):
            return x < y
    return a.bottleneck_s < b.bottleneck_s * (1 - _TIE)


def _best(choices: Iterable[LoadChoice]) -> LoadChoice:
    it = iter(choices)
    best = next(it)
    for c in it:
        if _better(c, best):
            best = c
    return best


def _for_head(
    k: int, costs: Sequence[DeviceCost], head: int, u: int, latency_s: float, slack: float
) -> LoadChoice | Infeasible:
    part = solve_rotation(k, costs, head)
    if isinstance(part, Infeasible):
        return part
    m = len(costs)
    chain = [costs[(head + j) % m] for j in range(m)]  # head first
    fixed = [c.fixed(j == 0) for j, c in enumerate(chain)]
    per = [c.per_block_s for c in chain]
    lim = [min(k, c.lim(j == 0)) for j, c in enumerate(chain)]
    taus = sorted(  # every bound from tau* up; each admits a division, since tau* does
        t
        for f, p, top in zip(fixed, per, lim, strict=True)
        for n in range(1, top + 1)
        if (t := f + n * p) >= part.bottleneck
    )

    def fill(i: int) -> tuple[int, ...]:
        counts = shortest_circuit(k, taus[i], fixed, per, lim)
        assert counts is not None, "a bound above tau* admits a division"
        return counts

    def circuit(i: int) -> float:
        return sum(f + n * p for f, p, n in zip(fixed, per, fill(i), strict=True)) + latency_s

    # per_token(tau) = max(tau, circuit(tau) / u): tau rises, the circuit falls, so the least is
    # where they cross (the first bound at or above circuit / u, or the one before it)
    cross = _first(len(taus), lambda i: taus[i] >= circuit(i) / u)
    best = min(max(taus[i], circuit(i) / u) for i in (cross - 1, cross) if 0 <= i < len(taus))
    # the tightest bound whose division stays within `slack` of that time: the most even stages
    # among divisions that good (a gain inside the probe's noise is not worth the balance)
    allowed = best * (1 + slack) * (1 + _TIE)
    tightest = _first(len(taus), lambda i: circuit(i) / u <= allowed)
    return _choice(head, fill(tightest), fixed, per, latency_s, u, part.bottleneck)


def _first(n: int, pred: Callable[[int], bool]) -> int:
    """The first i in [0, n) where a monotone pred turns true (n if it never does)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _choice(
    head: int,
    counts: Sequence[int],
    fixed: Sequence[float],
    per: Sequence[float],
    latency_s: float,
    u: int,
    tau_star: float,
) -> LoadChoice:
    stages = [f + n * p for f, p, n in zip(fixed, per, counts, strict=True)]
    bottleneck, circuit = max(stages), sum(stages) + latency_s
    return LoadChoice(
        head, unrotate(counts, head), bottleneck, circuit, max(bottleneck, circuit / u), tau_star
    )


def shortest_circuit(
    k: int, tau: float, fixed: Sequence[float], per: Sequence[float], lim: Sequence[int]
) -> tuple[int, ...] | None:
    """Block counts (chain order) with every stage within tau and the smallest sum of stages, or
    None: one block each, the rest onto the cheapest blocks first."""
    caps = [min(lim[i], blocks_within(tau, fixed[i], per[i])) for i in range(len(fixed))]
    if min(caps) < 1 or sum(caps) < k:
        return None
    counts, left = [1] * len(caps), k - len(caps)
    for i in sorted(range(len(caps)), key=lambda i: per[i]):
        add = min(caps[i] - 1, left)
        counts[i] += add
        left -= add
    return tuple(counts)
