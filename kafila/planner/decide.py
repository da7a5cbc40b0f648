"""The planner's entry point: ring order, division (by tier), head, admission -> Plan.

Pure: takes device reports, the model manifest and the session's declared context and
concurrency, returns a Plan (feasible, or refused with a reason naming the device).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from kafila.models.manifest import Manifest
from kafila.planner.admission import check_memory, explain_no_division
from kafila.planner.baselines import proportional_counts, uniform_counts
from kafila.planner.cost import (
    DeviceCost,
    Tier,
    Workload,
    choose_tier,
    costs_for,
    fmt_bytes,
    memory_shortfall,
)
from kafila.planner.devices import DeviceReport
from kafila.planner.drafting import MIN_CIRCUITS, PLAIN_ROW_SHARE, CircuitCounts, CircuitYield, figures
from kafila.planner.fetching import HELD_MARGIN, Bounds, Holdings, fetching, holdings_of, least_fetched
from kafila.planner.head import MU, HeadChoice, place_head, solve_rotation, unrotate
from kafila.planner.load import LoadChoice, divide_for_load
from kafila.planner.order import RingOrder, edge_price_s, order_ring, predicted_direct, ring_edges
from kafila.planner.partition import Infeasible
from kafila.planner.plan import Edge, Plan, Stage
from kafila.planner.reachability import DEFAULT_RULE, PairRule

DIVISIONS = ("kafila", "uniform", "memory")
# What the kafila division minimizes: "load", the session's time per token at its declared
# concurrency (kafila.planner.load); "bottleneck", the slowest stage alone (Algorithm 1 and head
# placement as the paper ran them, whatever the concurrency).
OBJECTIVES = ("load", "bottleneck")


def plan(
    devices: Sequence[DeviceReport],
    manifest: Manifest,
    *,
    context: int,
    concurrency: int = 1,
    division: str = "kafila",
    rule: PairRule = DEFAULT_RULE,
    mu: float = MU,
    use_block_probe: bool = True,
    anchor: int = 0,
    objective: str = "load",
    keep_head: bool = False,
    weights_host: str | None = None,
) -> Plan:
    """Plan one division. `anchor` indexes the member that opened the session; `keep_head` keeps
    the head there whatever another member would gain (a re-plan around a serving head, whose
    samplers and caches cannot move). `weights_host` names the member serving the checkpoint:
    with it, where the devices report what they hold (`DeviceReport.held`), the kafila division
    is, among those within HELD_MARGIN of the fastest, the one fetching least from that host
    (kafila.planner.fetching)."""
    return plan_all(
        devices,
        manifest,
        context=context,
        concurrency=concurrency,
        divisions=(division,),
        rule=rule,
        mu=mu,
        use_block_probe=use_block_probe,
        anchor=anchor,
        objective=objective,
        keep_head=keep_head,
        weights_host=weights_host,
    )[division]


def plan_all(
    devices: Sequence[DeviceReport],
    manifest: Manifest,
    *,
    context: int,
    concurrency: int = 1,
    divisions: Sequence[str] = DIVISIONS,
    rule: PairRule = DEFAULT_RULE,
    mu: float = MU,
    use_block_probe: bool = True,
    anchor: int = 0,
    objective: str = "load",
    keep_head: bool = False,
    weights_host: str | None = None,
) -> dict[str, Plan]:
    """Several divisions over one ring order (computed once), keyed by division name."""
    if not devices:
        raise ValueError("no devices to plan")
    names = [d.name for d in devices]
    if len(set(names)) != len(names):
        raise ValueError(f"device names must be unique, got {names}")
    unknown = set(divisions) - set(DIVISIONS)
    if unknown:
        raise ValueError(f"unknown division {sorted(unknown)}; choose from {DIVISIONS}")
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {OBJECTIVES}")
    w = Workload.of(manifest, context, concurrency)
    tier = choose_tier(devices)
    ring = order_ring(devices, rule, anchor)
    ordered = [devices[i] for i in ring.order]
    costs = costs_for(ordered, w, tier, use_block_probe) if tier is not Tier.WORKING_SET else None
    fixed = keep_head or tier is Tier.THROUGHPUT  # the head stays with the anchor (ordered[0])
    held = holdings_of(devices, weights_host)
    plans = {
        name: _division(name, ordered, ring, w, tier, costs, rule, mu, objective, fixed) for name in divisions
    }
    if held is None:
        return plans
    if "kafila" in plans and costs is not None and plans["kafila"].feasible:
        plans["kafila"] = _nearer(
            plans["kafila"], ordered, ring, w, tier, costs, rule, fixed, held, manifest, objective
        )
    return {name: _with_bytes(p, held, manifest) for name, p in plans.items()}


def _division(
    name: str,
    ordered: list[DeviceReport],
    ring: RingOrder,
    w: Workload,
    tier: Tier,
    costs: list[DeviceCost] | None,
    rule: PairRule,
    mu: float,
    objective: str,
    fixed: bool,
) -> Plan:
    k, m = w.n_blocks, len(ordered)
    if m > k:
        return _refused(name, ordered, ring, w, tier, explain_no_division(ordered, w))
    if name == "uniform":
        head, counts = 0, uniform_counts(k, m)
    elif name == "memory" or costs is None:
        head, counts = 0, proportional_counts(k, [d.memory_bytes for d in ordered])
    else:
        got = _solve(ordered, w, costs, rule, mu, objective, fixed)
        if isinstance(got, Infeasible):
            opener = memory_shortfall(ordered[0], w, 1, head=True) if fixed else None
            where = "with the opener in this tier" if tier is Tier.THROUGHPUT else "where it serves"
            why = f"the head stays {where}: {opener}" if opener else None
            head_at = 0 if fixed else None  # the opener's (or the serving head's)
            return _refused(name, ordered, ring, w, tier, why or explain_no_division(ordered, w, head_at))
        head, counts = got.head, got.counts
        if isinstance(got, LoadChoice) and got.circuit_bound:
            built = _build(name, ordered, ring, w, tier, costs, rule, head, counts)
            return replace(built, notes=(*built.notes, _load_note(built, got.tau_star_s, m)))
    return _build(name, ordered, ring, w, tier, costs, rule, head, counts)


def _solve(
    ordered: list[DeviceReport],
    w: Workload,
    costs: list[DeviceCost],
    rule: PairRule,
    mu: float,
    objective: str,
    fixed: bool,
) -> HeadChoice | LoadChoice | Infeasible:
    """The kafila division. The full tier places the head by rotation; `fixed` (the throughput
    tier, or a re-plan around a serving head) keeps it with the anchor, ordered[0]."""
    k, m = w.n_blocks, len(ordered)
    if objective == "bottleneck":
        if not fixed:
            return place_head(k, costs, anchor=0, mu=mu)
        part = solve_rotation(k, costs, 0)
        if isinstance(part, Infeasible):
            return part
        return HeadChoice(0, unrotate(part.counts, 0), part.bottleneck)
    heads = (0,) if fixed else range(m)
    latency = _ring_latency(ordered, rule)
    u = w.concurrency
    return divide_for_load(k, costs, concurrency=u, latency_s=latency, heads=heads, anchor=0, mu=mu)


def _nearer(
    p: Plan,
    ordered: list[DeviceReport],
    ring: RingOrder,
    w: Workload,
    tier: Tier,
    costs: list[DeviceCost],
    rule: PairRule,
    fixed: bool,
    held: Holdings,
    manifest: Manifest,
    objective: str,
) -> Plan:
    """`p`, or the division within HELD_MARGIN of its predicted time per token (one-row steps, as
    the division is chosen) that fetches fewer bytes from the host (kafila.planner.fetching)."""
    by_name = {d.name: c for d, c in zip(ordered, costs, strict=True)}
    stage_s = [by_name[s.name].stage_s(s.n_blocks, s.head) for s in p.stages]
    m, u = len(ordered), w.concurrency
    if objective == "bottleneck":
        bounds = Bounds(max(stage_s) * (1 + HELD_MARGIN), math.inf)
    else:
        latency = _ring_latency(ordered, rule)
        worst = max(max(stage_s), (sum(stage_s) + latency) / u) * (1 + HELD_MARGIN)
        bounds = Bounds(worst, worst * u - latency)
    heads = (0,) if fixed else range(m)
    names = [d.name for d in ordered]
    got = least_fetched(w.n_blocks, costs, names, heads, held, manifest, bounds)
    before = fetching(p, held, manifest)
    if got is None or (got[2].host_bytes, got[2].peer_bytes + got[2].host_bytes) >= (
        before.host_bytes,
        before.peer_bytes + before.host_bytes,
    ):
        return p
    head, counts, after = got
    built = _build(p.division, ordered, ring, w, tier, costs, rule, head, counts)
    slower = (built.per_token_s or 0.0) / (p.per_token_s or 1.0) - 1
    note = (
        f"placed by what members hold: {fmt_bytes(after.host_bytes)} from the host and "
        f"{fmt_bytes(after.peer_bytes)} from members, predicted {slower * 100:.1f}% slower a token than "
        f"the fastest plan, which fetched {fmt_bytes(before.host_bytes)} from the host"
    )
    return replace(built, notes=(*built.notes, note))


def _with_bytes(p: Plan, held: Holdings, manifest: Manifest) -> Plan:
    if not p.stages:
        return p
    f = fetching(p, held, manifest)
    return replace(p, host_bytes=f.host_bytes, peer_bytes=f.peer_bytes)


def _refused(
    name: str, ordered: list[DeviceReport], ring: RingOrder, w: Workload, tier: Tier, reason: str
) -> Plan:
    return Plan(
        division=name,
        feasible=False,
        reason=reason,
        tier=tier.value,
        ordering=ring.method,
        notes=_notes(tier, ring),
        order=tuple(d.name for d in ordered),
        head=None,
        stages=(),
        edges=(),
        n_blocks=w.n_blocks,
        context=w.context,
        concurrency=w.concurrency,
    )


def _build(
    name: str,
    ordered: list[DeviceReport],
    ring: RingOrder,
    w: Workload,
    tier: Tier,
    costs: list[DeviceCost] | None,
    rule: PairRule,
    head: int,
    counts: Sequence[int],
) -> Plan:
    m = len(ordered)
    chain = [(head + j) % m for j in range(m)]  # ring positions, head first
    stages, start = [], 0
    for pos in chain:
        d, n = ordered[pos], counts[pos]
        cost = costs[pos].stage_s(n, pos == head) if costs else None
        stages.append(
            Stage(
                d.name, start, start + n, pos == head, cost, w.resident_bytes(n, pos == head), d.memory_bytes
            )
        )
        start += n
    edges = tuple(_edge(ordered[a], ordered[b], rule) for a, b in ring_edges(chain))
    reason = check_memory(ordered, counts, head, w)
    probed = _with_figures(
        Plan(
            division=name,
            feasible=reason is None,
            reason=reason,
            tier=tier.value,
            ordering=ring.method,
            notes=_notes(tier, ring),
            order=tuple(ordered[p].name for p in chain),
            head=ordered[head].name,
            stages=tuple(stages),
            edges=edges,
            n_blocks=w.n_blocks,
            context=w.context,
            concurrency=w.concurrency,
        )
    )
    return _woken(probed, [costs[p] for p in chain]) if costs else probed


_TIER_NOTES = {
    Tier.FULL: "",
    Tier.THROUGHPUT: "throughput tier: some member has no bandwidth; blocks priced by FLOP/s, no head "
    "term, head kept with the opener",
    Tier.WORKING_SET: "working-set tier: nothing measured on every member; blocks proportional to "
    "memory, no stage times predicted",
}
_ORDER_NOTES = {
    "counting": "ring ordered by the NAT counting rule: some member has no rendezvous rtt",
    "rtt-heuristic": "ring ordered by cheapest insertion + 2-opt (more than 9 members)",
}


def _notes(tier: Tier, ring: RingOrder) -> tuple[str, ...]:
    order_note = _ORDER_NOTES.get(ring.method, "")
    if ring.bound_ratio is not None:
        order_note += f"; this ring costs at most {ring.bound_ratio:.2f}x the cheapest possible"
    return tuple(n for n in (_TIER_NOTES[tier], order_note) if n)


def _load_note(p: Plan, tau_star_s: float, m: int) -> str:
    """Why the plan's stages are uneven: its circuit and slowest stage as the plan predicts them
    (wake-ups included), against the most even division's slowest stage (a busy ring's: none)."""
    assert p.circuit_s is not None and p.bottleneck_s is not None
    u = p.concurrency
    return (
        f"{u} request{'s' if u != 1 else ''} in flight cannot keep {m} stages busy: "
        f"blocks divided for a short circuit ({p.circuit_s * 1e3:.1f} ms, slowest stage "
        f"{p.bottleneck_s * 1e3:.1f} ms) rather than the most even stages (slowest "
        f"{tau_star_s * 1e3:.1f} ms); a larger --concurrency evens them"
    )


def _ring_latency(ordered: list[DeviceReport], rule: PairRule) -> float:
    """The known edge latencies of the ring in this order, summed (a circuit's network part)."""
    edges = ring_edges(range(len(ordered)))
    return sum(_edge(ordered[a], ordered[b], rule).latency_s or 0.0 for a, b in edges)


def _edge(a: DeviceReport, b: DeviceReport, rule: PairRule) -> Edge:
    direct = predicted_direct(a, b, rule)
    price = edge_price_s(a, b, direct)
    return Edge(a.name, b.name, direct, None if price is None else price / 2)


def _woken(p: Plan, costs: Sequence[DeviceCost]) -> Plan:
    """`p` (its figures from the probed costs) with each stage's wake-up after the idle gap the
    division leaves it: the session's time per token (`per_token_s`) less its own step. One user
    on a ring of three: a small stage idles through most of a circuit."""
    if p.per_token_s is None:
        return p
    stages = []
    for s, c in zip(p.stages, costs, strict=True):
        assert s.cost_s is not None  # per_token_s exists only when every stage has a cost
        stages.append(replace(s, cost_s=s.cost_s + c.wake_extra_s(s.cost_s, p.per_token_s - s.cost_s)))
    return _with_figures(replace(p, stages=tuple(stages)))


def _with_figures(p: Plan) -> Plan:
    """`p` with its bottleneck, circuit and token figures from its stages' one-row steps, its
    known edge latencies and what each circuit yields (`Plan.circuit_yield`)."""
    stage_s = [s.cost_s for s in p.stages if s.cost_s is not None]
    if len(stage_s) != len(p.stages) or not stage_s:
        return p
    known = [e.latency_s for e in p.edges if e.latency_s is not None]
    f = figures(stage_s, known, p.concurrency, p.circuit_yield)
    return replace(
        p,
        bottleneck_s=f.bottleneck_s,
        imbalance=max(stage_s) / min(stage_s),
        utilisation=sum(stage_s) / len(stage_s) / max(stage_s),
        circuit_s=f.circuit_s,
        network_priced=len(known) == len(p.edges),
        tokens_s=f.tokens_s,
        per_token_s=f.per_token_s,
    )


def with_yield(p: Plan, y: CircuitYield) -> Plan:
    """`p` with its figures for circuits yielding `y` (e.g. the tokens per circuit a drafting
    head measured): the division stays as it is."""
    drafted = replace(p, tokens_per_circuit=y.tokens, rows_per_circuit=y.rows, row_share=y.row_share)
    return _with_figures(drafted)


def measured(p: Plan, counts: CircuitCounts, assumed_share: float, least: int = MIN_CIRCUITS) -> Plan:
    """`p` priced for what a head's circuits measured (`counts`; each drafted row at the measured
    share of a step, else at `assumed_share`) once it counted `least` of them, else for plain
    decoding: a plan priced before for another yield gets the current one."""
    y = counts.circuit_yield(assumed_share) if counts.circuits >= least else CircuitYield()
    return p if y == p.circuit_yield else with_yield(p, y)


def as_planned(p: Plan) -> Plan:
    """`p` with the figures of plain decoding (one token per circuit), as the planner priced it."""
    return measured(p, CircuitCounts(), PLAIN_ROW_SHARE)


def reprice(p: Plan, devices: Sequence[DeviceReport], rule: PairRule = DEFAULT_RULE) -> Plan:
    """`p` with its ring's edges (direct or relayed, and their latency) priced again from `devices`,
    e.g. after a punch failed where the NAT classes predicted it would succeed; the order and the
    division stay as they are."""
    by_name = {d.name: d for d in devices}
    chain = range(len(p.order))
    edges = tuple(_edge(by_name[p.order[a]], by_name[p.order[b]], rule) for a, b in ring_edges(chain))
    return _with_figures(replace(p, edges=edges))
