"""Pure planning decisions: cost model, ring order, PARTITION, head placement, admission, baselines.

Imports nothing heavier than the standard library (and the pure kafila.models manifest/config).
Entry points: `plan()` / `plan_all()` (kafila.planner.decide) taking `DeviceReport`s and a
`Manifest`, returning `Plan` values.
"""

from kafila.planner.decide import DIVISIONS, plan, plan_all
from kafila.planner.devices import DeviceReport
from kafila.planner.plan import Edge, Plan, Stage
from kafila.planner.reachability import DEFAULT_RULE, LINUX_RULE, PAPER_RULE, Nat, NatClass

__all__ = [
    "DEFAULT_RULE",
    "DIVISIONS",
    "LINUX_RULE",
    "PAPER_RULE",
    "DeviceReport",
    "Edge",
    "Nat",
    "NatClass",
    "Plan",
    "Stage",
    "plan",
    "plan_all",
]
