"""Membership that changes mid-session: what the host decides when a member is lost, arrives, or
the network contradicts the plan (pure: inputs in, a decision out; the session shell acts on it).

The host keeps every admitted member's probe (`DeviceReport`) for the whole session, so a re-plan
runs the same planner (`kafila.planner.decide.plan`) over the members present now, with no new
measurement. Each decision says what every member must fetch: only the blocks (and the head) its
new share holds that its old share did not (`Fetch`), which is the minimum any division change
needs; a member's cache may already hold some of them.

Rules, in the order the host applies them:
- The coordinating host cannot plan around itself: `on_lost` of the host ends the session. A
  lost host's role passes first to its successor (kafila.planner.succession), which then holds
  the membership as its host and plans around the old one as around any member.
- Every re-plan anchors the planner at the serving head (the host where the head is gone), and keeps
  the head there while it is present: a serving head's samplers and caches do not move. A lost
  head is placed anew by the planner; the requests in flight move to it (kafila.planner.moves).
- A lost member: re-plan over everyone present, spares included. If that plan is refused (the
  survivors cannot hold the model), the session ends with the planner's reason, which names the
  device and its numbers, as forming's refusal does.
- An arriving member (new or returning): re-plan to include it only when the predicted time per
  token improves by more than `margin` (the head margin, 5%); otherwise it waits as a spare.
- Measured paths that contradict the plan (an edge predicted direct that runs through the relay):
  re-price the current ring with the measured paths; re-plan (which may re-order) only when that
  improves the predicted time per token by more than `margin`; otherwise keep the ring and only
  correct the plan's edges. The same holds while serving, for a path that changes and stays
  changed (`with_path`, `on_measured`): relayed against the prediction, or direct again.
- Every plan a decision weighs is priced for what the serving plan's circuits yield
  (`Plan.circuit_yield`: the tokens per circuit a drafting head measured, where the host priced
  `Membership.plan` with them), so a time per token is compared with one of the same yield.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kafila.models.manifest import Manifest
from kafila.planner.decide import plan, reprice, with_yield
from kafila.planner.devices import DeviceReport
from kafila.planner.drafting import CircuitYield
from kafila.planner.head import MU
from kafila.planner.order import predicted_direct
from kafila.planner.plan import Plan
from kafila.planner.reachability import DEFAULT_RULE, PairRule


@dataclass(frozen=True)
class PlanTerms:
    """The session's declared terms, which every re-plan keeps (plan()'s keyword arguments)."""

    context: int
    concurrency: int = 1
    division: str = "kafila"
    rule: PairRule = DEFAULT_RULE
    mu: float = MU
    use_block_probe: bool = True
    objective: str = "load"


@dataclass(frozen=True)
class Membership:
    """What the host knows: the plan serving now, its epoch, and every admitted member's probe.

    `reports` is in admission order (the host first); a member in `reports` but not in the plan
    is a spare. `present` is who is reachable now.
    """

    epoch: int
    plan: Plan
    reports: tuple[DeviceReport, ...]
    present: frozenset[str]
    host: str

    def __post_init__(self) -> None:
        names = [r.name for r in self.reports]
        if len(set(names)) != len(names):
            raise ValueError(f"member names must be unique, got {names}")
        if self.host not in names:
            raise ValueError(f"the host {self.host!r} has no report; members: {names}")
        missing = set(self.plan.order) - set(names)
        if missing:
            raise ValueError(f"the plan names members without a report: {sorted(missing)}")

    @property
    def spares(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.reports if r.name in self.present and r.name not in self.plan.order)


@dataclass(frozen=True)
class Fetch:
    """What one member must load for its new share, and how many bytes that is at most."""

    member: str
    blocks: tuple[int, ...]  # block indices it did not hold before
    head: bool  # the head's tensors (embedding, final norm, unembedding) it did not hold before
    bytes: int


@dataclass(frozen=True)
class Replan:
    epoch: int
    plan: Plan
    cause: str
    fetches: tuple[Fetch, ...]  # members with nothing to fetch are left out

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.fetches)


@dataclass(frozen=True)
class Keep:
    """No re-plan: the ring serves as it is (a spare waits, or a change was not worth it)."""

    reason: str
    plan: Plan  # the plan serving, its edges corrected where paths were measured


@dataclass(frozen=True)
class End:
    reason: str


Decision = Replan | Keep | End


def on_lost(m: Membership, name: str, cause: str, manifest: Manifest, terms: PlanTerms) -> Decision:
    """Member `name` stopped answering (`cause`: what said so)."""
    if name == m.host:
        return End(f"the session host {name} left ({cause})")
    present = m.present - {name}
    if name not in m.plan.order:
        return Keep(f"spare {name} left ({cause})", m.plan)
    return _replan(replace(m, present=present), manifest, terms, f"{name} was lost ({cause})")


def on_arrived(m: Membership, report: DeviceReport, manifest: Manifest, terms: PlanTerms) -> Decision:
    """A member joined the serving session (a new one, or one that was lost and came back)."""
    grown = with_member(m, report)
    candidate = _plan_over(grown, manifest, terms)
    if not candidate.feasible:
        return Keep(f"{report.name} waits as a spare: {candidate.reason}", m.plan)
    gain = _gain(m.plan, candidate)
    if gain is None or gain <= terms.mu:
        return Keep(f"{report.name} waits as a spare: {_why_not(gain, terms.mu)}", m.plan)
    cause = f"{report.name} joined: time per token {_pct(gain)} better"
    spares = [n for n in candidate.order if n not in m.plan.order and n != report.name]
    if spares:  # the plan over everyone present takes waiting spares in too
        cause += f", with spare{'s' if len(spares) > 1 else ''} {', '.join(spares)}"
    return _decided(grown, candidate, manifest, cause)


def with_member(m: Membership, report: DeviceReport) -> Membership:
    """`m` with the member of `report` present, its report replacing any it had (one back)."""
    reports = (*(r for r in m.reports if r.name != report.name), report)
    return replace(m, reports=reports, present=m.present | {report.name})


def on_paths(
    m: Membership, relayed: Sequence[tuple[str, str]], manifest: Manifest, terms: PlanTerms
) -> Decision:
    """Edges measured through the relay although the plan predicted them direct."""
    edges = ", ".join(f"{a}->{b}" for a, b in relayed)
    return on_measured(
        m, _with_relayed(m.reports, relayed), manifest, terms, f"{edges} run through the relay"
    )


def on_measured(
    m: Membership, reports: tuple[DeviceReport, ...], manifest: Manifest, terms: PlanTerms, what: str
) -> Decision:
    """The members' paths as measured now (`reports`, `what` says which changed): the ring serving
    re-priced with them (Keep, its edges and costs corrected), or a plan over them (Replan) when
    that is more than the head margin faster."""
    measured = replace(m, reports=reports)
    repriced = reprice(m.plan, reports, terms.rule)  # the ring as it runs now
    candidate = _plan_over(measured, manifest, terms)
    gain = _gain(repriced, candidate) if candidate.feasible else None
    if gain is None or gain <= terms.mu:
        return Keep(f"{what}; {_why_not(gain, terms.mu)}", repriced)
    return _decided(measured, candidate, manifest, f"{what}: re-planned, {_pct(gain)} better")


def with_path(
    reports: tuple[DeviceReport, ...],
    probed: Sequence[DeviceReport],
    pair: tuple[str, str],
    direct: bool,
    rule: PairRule = DEFAULT_RULE,
) -> tuple[DeviceReport, ...] | None:
    """`reports` with the link between `pair` measured `direct` (or relayed) as it runs now, or
    None when that changes nothing the planner prices: a relayed link the reports predicted
    relayed, a direct one they did not mark relayed. A link direct again gets back the round trip
    its members measured when they joined (`probed`: their reports as they sent them)."""
    a, b = pair
    by_name = {r.name: r for r in reports}
    if a not in by_name or b not in by_name or a == b:
        return None
    marked = b in by_name[a].relayed_with or a in by_name[b].relayed_with
    if not direct:
        return _with_relayed(reports, [pair]) if predicted_direct(by_name[a], by_name[b], rule) else None
    if not marked:
        return None
    first = {r.name: r for r in probed}
    return tuple(
        _unrelayed(r, b if r.name == a else a, first.get(r.name)) if r.name in pair else r for r in reports
    )


def _unrelayed(r: DeviceReport, peer: str, probed: DeviceReport | None) -> DeviceReport:
    rtts = dict(r.pair_rtt_s)
    if probed is not None and peer in probed.pair_rtt_s:
        rtts[peer] = probed.pair_rtt_s[peer]
    return replace(r, relayed_with=r.relayed_with - {peer}, pair_rtt_s=rtts)


def contradicted(
    reports: Sequence[DeviceReport], measured: Mapping[tuple[str, str], bool], rule: PairRule = DEFAULT_RULE
) -> tuple[tuple[str, str], ...]:
    """The measured pairs (`measured[(a, b)]`: True when the link runs direct) that run through the
    relay although `reports` and `rule` predict them direct, in `measured`'s order: what `on_paths`
    takes. A pair predicted relayed that punched is not a contradiction the plan must fix (the
    prediction errs toward the relay, and the link moves to the direct path by itself)."""
    by_name = {r.name: r for r in reports}
    return tuple(
        (a, b)
        for (a, b), direct in measured.items()
        if not direct and a in by_name and b in by_name and predicted_direct(by_name[a], by_name[b], rule)
    )


def measured_reports(
    reports: Sequence[DeviceReport], measured: Mapping[tuple[str, str], bool], rule: PairRule = DEFAULT_RULE
) -> tuple[DeviceReport, ...]:
    """`reports` with the pairs `measured` ran through the relay against the prediction recorded
    (`relayed_with`), as the host keeps them for the session: a later re-plan prices those edges as
    they ran, not as the classifier predicted them."""
    return _with_relayed(reports, contradicted(reports, measured, rule))


def fetches(old: Plan, new: Plan, manifest: Manifest) -> tuple[Fetch, ...]:
    """What each member of `new` lacks from its share in `old` (a member new to the ring lacks all)."""
    out = []
    for stage in new.stages:
        held: set[int] = set()
        held_head = False
        if stage.name in old.order:
            before = old.stage(stage.name)
            held, held_head = set(range(before.start, before.stop)), before.head
        blocks = tuple(i for i in range(stage.start, stage.stop) if i not in held)
        head = stage.head and not held_head
        nbytes = sum(manifest.block_bytes[i] for i in blocks) + (manifest.head_resident_bytes if head else 0)
        if blocks or head:
            out.append(Fetch(stage.name, blocks, head, nbytes))
    return tuple(out)


def _replan(m: Membership, manifest: Manifest, terms: PlanTerms, cause: str) -> Decision:
    new = _plan_over(m, manifest, terms)
    if not new.feasible:
        return End(f"{cause}; the members left cannot hold the model: {new.reason}")
    return _decided(m, new, manifest, cause)


def _decided(m: Membership, new: Plan, manifest: Manifest, cause: str) -> Replan:
    return Replan(m.epoch + 1, new, cause, fetches(m.plan, new, manifest))


def _present_reports(m: Membership) -> list[DeviceReport]:
    return [r for r in m.reports if r.name in m.present]


def anchor_of(m: Membership) -> str:
    """Whom a re-plan anchors at: the serving head while it is present (the planner keeps the head
    there, `keeps_head`, so requests in flight stay where their samplers and caches are), else the
    host."""
    head = m.plan.head
    return head if head is not None and head in m.present else m.host


def keeps_head(m: Membership) -> bool:
    """Whether a re-plan must keep the head where it is: it serves and is still present. A lost
    head's requests are carried to the new one by the members that forwarded them; a present
    head is not moved (its samplers, caches and queue would have to be handed over, for a gain
    within the planner's noise: the head margin alone once moved it on a noisy bandwidth probe)."""
    return m.plan.head is not None and m.plan.head in m.present


def _plan_over(m: Membership, manifest: Manifest, terms: PlanTerms) -> Plan:
    """plan() over everyone present, in admission order, anchored at the serving head (`anchor_of`),
    which keeps the head while present (`keeps_head`), preferring among plans about as fast the one
    that fetches least from the host, by what the reports say each member holds (`Membership`
    adds each committed plan's shares: `kafila.planner.fetching.after_plan`), priced for what the
    serving plan's circuits yield."""
    reports = _present_reports(m)
    anchor = [r.name for r in reports].index(anchor_of(m))
    chosen = plan(
        reports,
        manifest,
        context=terms.context,
        concurrency=terms.concurrency,
        division=terms.division,
        rule=terms.rule,
        mu=terms.mu,
        use_block_probe=terms.use_block_probe,
        anchor=anchor,
        objective=terms.objective,
        keep_head=keeps_head(m),
        weights_host=m.host,  # with what the members hold, the plan among near-equals fetching least from it
    )
    y = m.plan.circuit_yield
    return with_yield(chosen, y) if chosen.feasible and y != CircuitYield() else chosen


def _with_relayed(
    reports: Sequence[DeviceReport], relayed: Sequence[tuple[str, str]]
) -> tuple[DeviceReport, ...]:
    peers: dict[str, set[str]] = {}
    for a, b in relayed:
        peers.setdefault(a, set()).add(b)
        peers.setdefault(b, set()).add(a)
    return tuple(
        replace(r, relayed_with=r.relayed_with | peers[r.name], pair_rtt_s=_drop(r.pair_rtt_s, peers[r.name]))
        if r.name in peers
        else r
        for r in reports
    )


def _drop(rtts: Mapping[str, float], names: set[str]) -> dict[str, float]:
    return {k: v for k, v in rtts.items() if k not in names}


def _gain(old: Plan, new: Plan) -> float | None:
    """How much lower the new predicted time per token is, as a share of the old (None: unknown)."""
    if old.per_token_s is None or new.per_token_s is None or old.per_token_s <= 0:
        return None
    return (old.per_token_s - new.per_token_s) / old.per_token_s


def _why_not(gain: float | None, mu: float) -> str:
    if gain is None:
        return "the time per token cannot be predicted without every member's measurements"
    if gain <= -0.0005:
        return f"time per token {_pct(-gain)} worse with a new plan"
    if gain <= 0.0005:
        return "no new plan is faster"
    return f"time per token {_pct(gain)} better, not more than the {_pct(mu)} margin"


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"
