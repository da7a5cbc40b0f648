"""Where a plan's weights come from, and the plan among near-equals that fetches least from the host.

Every member fetches the blocks (and the head's tensors) of its share that its own disk lacks. A
range some other member present holds on disk (`DeviceReport.held`) comes from that member; one
no member but the host holds comes over the host's uplink, the session's slowest and most shared
path (a residential uplink: minutes a GB). The host's own share costs nothing.

The tie-break: among the divisions and heads whose predicted time per token is within
HELD_MARGIN of the plan the planner would choose without holdings, the one with the fewest host
bytes, then the fewest bytes fetched at all (a member back with its old share takes it again),
then the shortest circuit. Where that is the plan chosen anyway, it stays as it is.

Exact, for a given ring order: a stage's bytes depend only on its member and its block range, and
a division is a chain of ranges from the head's, so a dynamic program over (stage, first block)
keeps, per state, the divisions not beaten on both (host bytes, bytes fetched) and circuit; the
per-stage bound prunes the block counts and the circuit bound (the time per token, circuit / U)
the Pareto sets. O(m k^2 F) per head, F the Pareto set's size (a few where holdings are whole
shards).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kafila.models.manifest import Manifest
from kafila.planner.cost import DeviceCost
from kafila.planner.devices import DeviceReport
from kafila.planner.head import unrotate
from kafila.planner.held import Held
from kafila.planner.partition import blocks_within
from kafila.planner.plan import Plan

# How much slower (predicted time per token) a plan may be than the one chosen without holdings
# and still be preferred for fetching fewer bytes from the host. Below the head margin (5%): that
# margin is the probes' noise, where a prediction cannot tell two plans apart; the bytes a plan
# saves are paid once, its time per token on every token, so the tie-break stays inside it.
HELD_MARGIN = 0.03
_TIE = 1e-9  # relative: a bound's own division must pass its bound despite rounding


@dataclass(frozen=True)
class Fetching:
    """Bytes a plan's members fetch: from the host, and from other members that hold them."""

    host_bytes: int
    peer_bytes: int


@dataclass(frozen=True)
class Holdings:
    """What the planner knows of the members' disks: the host's name (it holds the checkpoint)
    and each member's report (`None`: not reported, counted as holding nothing)."""

    host: str
    held: Mapping[str, Held | None]

    @property
    def informative(self) -> bool:
        """Some member other than the host holds something: a choice of source exists."""
        return any(h is not None and not h.empty for n, h in self.held.items() if n != self.host)

    def held_elsewhere(self, block: int) -> bool:
        """Some member other than the host holds `block`."""
        return any(h is not None and block in h.blocks for n, h in self.held.items() if n != self.host)

    def head_held_elsewhere(self) -> bool:
        """Some member other than the host holds the head's tensors."""
        return any(h is not None and h.head for n, h in self.held.items() if n != self.host)


def holdings_of(devices: Sequence[DeviceReport], host: str | None) -> Holdings | None:
    """The holdings the devices report, when the host is named and among them and some member
    other than it holds something; else None (the planner then plans as without holdings)."""
    if host is None or host not in {d.name for d in devices}:
        return None
    h = Holdings(host, {d.name: d.held for d in devices})
    return h if h.informative else None


def costs_per_block(
    name: str, h: Holdings, manifest: Manifest
) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Per block, (host bytes, bytes fetched) when member `name` holds it in its share; and the
    same for the head's tensors."""
    if name == h.host:
        return [(0, 0)] * manifest.n_blocks, (0, 0)
    own = h.held.get(name) or Held()
    out = []
    for b, n in enumerate(manifest.block_bytes):
        mine = b in own.blocks
        out.append((0 if mine or h.held_elsewhere(b) else n, 0 if mine else n))
    hb = manifest.head_resident_bytes
    head = (0 if own.head or h.head_held_elsewhere() else hb, 0 if own.head else hb)
    return out, head


def fetching(p: Plan, h: Holdings, manifest: Manifest) -> Fetching:
    """The bytes `p`'s members fetch from the host and from each other, given `h`."""
    host = fetched = 0
    for s in p.stages:
        per, head = costs_per_block(s.name, h, manifest)
        parts = [per[b] for b in range(s.start, s.stop)] + ([head] if s.head else [])
        host += sum(x for x, _ in parts)
        fetched += sum(y for _, y in parts)
    return Fetching(host, fetched - host)


@dataclass(frozen=True)
class Bounds:
    """What a plan must stay within: each stage's time, and the stages' sum (the circuit less
    its edges: the time per token x concurrency less the edge latencies)."""

    stage_s: float
    stages_sum_s: float


def least_fetched(
    k: int,
    costs: Sequence[DeviceCost],
    names: Sequence[str],
    heads: Sequence[int],
    h: Holdings,
    manifest: Manifest,
    bounds: Bounds,
) -> tuple[int, tuple[int, ...], Fetching] | None:
    """Over the `heads` (indices into the ring order of `costs`/`names`), the division within
    `bounds` with the fewest host bytes, then bytes fetched, then the shortest sum of stages:
    (head, block counts in ring order, its bytes), or None when no division is within bounds."""
    m = len(costs)
    total = sum(manifest.block_bytes) + manifest.head_resident_bytes
    scale = m * total + 1  # host bytes first, then bytes fetched, in one integer
    per_member = {n: costs_per_block(n, h, manifest) for n in names}
    best: tuple[int, float, int, tuple[int, ...]] | None = None
    for r in heads:
        chain = [(r + j) % m for j in range(m)]
        chained = [per_member[names[i]] for i in chain]
        known = None if best is None else best[0]  # bytes no later head may exceed
        got = _best_for_head(k, [costs[i] for i in chain], chained, scale, bounds, known)
        if got is not None and (best is None or (got[0], got[1]) < (best[0], best[1])):
            best = (got[0], got[1], r, got[2])
    if best is None:
        return None
    obj, _, r, counts = best
    return r, unrotate(counts, r), Fetching(obj // scale, obj % scale - obj // scale)


_Front = list[tuple[int, float, tuple[int, ...]]]  # (bytes objective, sum of stages, counts so far)


def _best_for_head(
    k: int,
    chain: Sequence[DeviceCost],
    per: Sequence[tuple[list[tuple[int, int]], tuple[int, int]]],
    scale: int,
    bounds: Bounds,
    known: int | None,
) -> tuple[int, float, tuple[int, ...]] | None:
    """The least (bytes, sum of stages) division for one head, or None; bytes only grow along
    the chain, so a partial division already over `known` (an earlier head's best) is dropped."""
    m = len(chain)
    fixed = [c.fixed(j == 0) for j, c in enumerate(chain)]
    step = [c.per_block_s for c in chain]
    caps = [
        min(k, c.lim(j == 0), blocks_within(bounds.stage_s * (1 + _TIE), fixed[j], step[j]))
        for j, c in enumerate(chain)
    ]
    if min(caps) < 1:
        return None
    prefix = []  # prefix[j][s]: objective of blocks [0, s) on the chain's member j
    for blocks, _ in per:
        acc, row = 0, [0]
        for host, got in blocks:
            acc += host * scale + got
            row.append(acc)
        prefix.append(row)
    head_obj = per[0][1][0] * scale + per[0][1][1]
    least_rest = [sum(fixed[i] + step[i] for i in range(j + 1, m)) for j in range(m)]
    limit = bounds.stages_sum_s * (1 + _TIE)
    fronts: dict[int, _Front] = {0: [(head_obj, 0.0, ())]}
    for j in range(m):
        rest = m - 1 - j
        nxt: dict[int, _Front] = {}
        for s, front in fronts.items():
            last = k - s  # the last stage takes what is left
            ns = range(1, min(caps[j], k - s - rest) + 1) if rest else range(last, last + 1)
            for n in ns if rest or 1 <= last <= caps[j] else ():
                add = prefix[j][s + n] - prefix[j][s]
                took = fixed[j] + n * step[j]
                for obj, circ, counts in front:
                    c = circ + took
                    if c + least_rest[j] <= limit and (known is None or obj + add <= known):
                        nxt.setdefault(s + n, []).append((obj + add, c, (*counts, n)))
        fronts = {s: _pareto(f) for s, f in nxt.items()}
    final = fronts.get(k)
    return min(final, key=lambda e: (e[0], e[1])) if final else None


def _pareto(front: _Front) -> _Front:
    """The entries no other beats on both the bytes objective and the sum of stages."""
    out: _Front = []
    for e in sorted(front, key=lambda e: (e[0], e[1])):
        if not out or e[1] < out[-1][1]:
            out.append(e)
    return out


def after_plan(reports: Sequence[DeviceReport], p: Plan) -> tuple[DeviceReport, ...]:
    """`reports` with what `p` left on each member's disk: its own share (fetched before it
    served) and the next member's in the ring (the replica each member keeps,
    kafila.session.weights.replicas). Only reports that said what they hold are added to (one
    that did not stays unknown)."""
    if not p.stages:
        return tuple(reports)
    out = []
    for r in reports:
        if r.held is None or r.name not in p.order:
            out.append(r)
            continue
        own, nxt = p.stage(r.name), p.stage(p.successor(r.name))
        held = r.held.union(range(own.start, own.stop), own.head).union(range(nxt.start, nxt.stop), nxt.head)
        out.append(replace(r, held=held))
    return tuple(out)
