"""The host's choice of plan: every division priced, the chosen one checked, and the lines about it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kafila.engine import DTYPES
from kafila.models.checkpoint import Checkpoint
from kafila.models.manifest import Manifest
from kafila.obs.log import get_logger
from kafila.planner.cost import fmt_bytes
from kafila.planner.decide import plan_all
from kafila.planner.devices import DeviceReport
from kafila.planner.plan import Plan
from kafila.planner.replan import Keep, Membership, PlanTerms, Replan, contradicted, on_paths
from kafila.session.errors import SessionError
from kafila.session.progress import say
from kafila.session.terms import Options

log = get_logger("kafila.session.forming.plans")


def fmt_plans(plans: dict[str, Plan]) -> str:
    """The chosen division next to the uniform and memory-proportional predictions."""
    rows = [
        f"{'division':<9} {'blocks per member':<40} {'bneck ms':>9} {'imbal':>6} {'util':>5} {'tok/s':>7}"
    ]
    for name, p in plans.items():
        if not p.feasible:
            rows.append(f"{name:<9} refused: {p.reason}")
            continue
        blocks = " ".join(f"{s.name}:{s.n_blocks}" for s in p.stages)
        rows.append(
            f"{name:<9} {blocks:<40} {(p.bottleneck_s or 0) * 1e3:>9.2f} {p.imbalance or 0:>6.2f} "
            f"{p.utilisation or 0:>5.0%} {p.tokens_s or 0:>7.1f}"
        )
    fetch = [
        f"{name} {fmt_bytes(p.host_bytes)} from the host + {fmt_bytes(p.peer_bytes or 0)} from members"
        for name, p in plans.items()
        if p.feasible and p.host_bytes is not None
    ]
    if fetch:  # some member reported what its disk holds of the checkpoint
        rows.append("weights to fetch: " + "; ".join(fetch))
    notes = dict.fromkeys(n for p in plans.values() for n in p.notes)  # once each, in order
    return "\n".join(rows + [f"note: {n}" for n in notes])


def say_ready(plan: Plan) -> None:
    """Every member's last line of forming (the host's is what `kafila demo` waits for)."""
    n = len(plan.order)
    say(f"session ready: {n} member{'s' if n > 1 else ''}, head {plan.head}, ring {' -> '.join(plan.order)}")


def session_manifest(ckpt: Checkpoint, opts: Options) -> Manifest:
    """The model priced in the session's dtype and weight format."""
    return ckpt.manifest(DTYPES[opts.dtype], opts.quant)


def choose_plan(devices: list[DeviceReport], ckpt: Checkpoint, opts: Options) -> tuple[Plan, dict[str, Any]]:
    manifest = session_manifest(ckpt, opts)
    plans = plan_all(
        devices,
        manifest,
        context=opts.context,
        concurrency=opts.concurrency,
        anchor=0,
        objective=opts.objective,
        weights_host=devices[0].name,  # the host (its report first) serves the checkpoint
    )
    say("plans for this session (predicted):\n" + fmt_plans(plans))
    plan = plans[opts.division]
    if not plan.feasible:
        raise SessionError(f"the session cannot be formed with the {opts.division} division: {plan.reason}")
    return plan, {name: p.summary() for name, p in plans.items()}


def with_measured_paths(
    plan: Plan,
    devices: Sequence[DeviceReport],
    measured: Mapping[tuple[str, str], bool],
    manifest: Manifest,
    opts: Options,
    host: str,
) -> Plan:
    """`plan` after the paths the host's links measured (`measured[(a, b)]`: True when direct),
    before the plan is sent and any weights move: an edge predicted direct that runs through the
    relay is re-priced; the ring is re-planned (kafila.planner.replan.on_paths) when that makes the
    time per token more than the head margin better, else it stays and its edges and predicted
    costs say what runs."""
    relayed = contradicted(devices, measured)
    if not relayed:
        return plan
    names = frozenset(d.name for d in devices)
    terms = PlanTerms(opts.context, opts.concurrency, opts.division, objective=opts.objective)
    decision = on_paths(Membership(0, plan, tuple(devices), names, host), relayed, manifest, terms)
    if not isinstance(decision, Keep | Replan):
        return plan
    why = decision.cause if isinstance(decision, Replan) else decision.reason
    log.info(
        "plan_paths_measured",
        relayed=[f"{a}->{b}" for a, b in relayed],
        replanned=isinstance(decision, Replan),
        why=why,
        per_token_ms_before=_ms(plan.per_token_s),
        per_token_ms=_ms(decision.plan.per_token_s),
    )
    verb = "re-planned" if isinstance(decision, Replan) else "corrected"
    say(f"plan {verb} with the measured paths: {why}")
    return decision.plan


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 3)
