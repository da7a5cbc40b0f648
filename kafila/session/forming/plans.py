"""The host's choice of plan: every division priced, the chosen one checked, and the lines about it."""

from __future__ import annotations

from typing import Any

from kafila.engine import DTYPES
from kafila.models.checkpoint import Checkpoint
from kafila.planner.decide import plan_all
from kafila.planner.devices import DeviceReport
from kafila.planner.plan import Plan
from kafila.session.errors import SessionError
from kafila.session.progress import say
from kafila.session.terms import Options


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
    notes = dict.fromkeys(n for p in plans.values() for n in p.notes)  # once each, in order
    return "\n".join(rows + [f"note: {n}" for n in notes])


def say_ready(plan: Plan) -> None:
    """Every member's last line of forming (the host's is what `kafila demo` waits for)."""
    n = len(plan.order)
    say(f"session ready: {n} member{'s' if n > 1 else ''}, head {plan.head}, ring {' -> '.join(plan.order)}")


def choose_plan(devices: list[DeviceReport], ckpt: Checkpoint, opts: Options) -> tuple[Plan, dict[str, Any]]:
    manifest = ckpt.manifest(DTYPES[opts.dtype], opts.quant)  # priced in the session's dtype and format
    plans = plan_all(
        devices,
        manifest,
        context=opts.context,
        concurrency=opts.concurrency,
        anchor=0,
        objective=opts.objective,
    )
    say("plans for this session (predicted):\n" + fmt_plans(plans))
    plan = plans[opts.division]
    if not plan.feasible:
        raise SessionError(f"the session cannot be formed with the {opts.division} division: {plan.reason}")
    return plan, {name: p.summary() for name, p in plans.items()}
