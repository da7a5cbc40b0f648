"""The exact dynamic program against brute force, and head placement (mu = 0) against it at the
paper's sizes (up to 64 blocks on 6 devices), where brute force is out of reach."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings

from kafila.models.presets import resolve_manifest
from kafila.planner import plan
from kafila.planner.cost import Tier, Workload, costs_for
from kafila.planner.exact import exact_division, exact_for_head
from kafila.planner.fleet import parse_fleet
from kafila.planner.head import MU, HeadChoice, place_head
from kafila.planner.partition import Infeasible
from tests.planner.test_head import fleets, rotation_optimum


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


@settings(max_examples=150, deadline=None)
@given(fleets(max_m=4, max_k=9))
def test_exact_equals_brute_force_for_every_head(case):
    k, costs = case
    for h in range(len(costs)):
        want = rotation_optimum(k, costs, h)
        got = exact_for_head(k, costs, h)
        if want is None:
            assert got is None
            continue
        assert got is not None and close(got.bottleneck, want)
        assert sum(got.counts) == k
        assert all(1 <= n <= c.lim(i == h) for i, (n, c) in enumerate(zip(got.counts, costs, strict=True)))
        assert close(
            max(c.stage_s(n, i == h) for i, (n, c) in enumerate(zip(got.counts, costs, strict=True))), want
        )


@settings(max_examples=60, deadline=None)
@given(fleets(max_m=6, max_k=64))
def test_head_placement_without_margin_equals_exact_optimum_at_paper_sizes(case):
    k, costs = case
    want = exact_division(k, costs)
    got = place_head(k, costs, anchor=0, mu=0.0)
    if want is None:
        assert isinstance(got, Infeasible)
        return
    assert isinstance(got, HeadChoice) and close(got.bottleneck, want.bottleneck)


FLEETS = Path(__file__).resolve().parents[2] / "examples" / "fleets"


@pytest.mark.parametrize("fleet_name", ["lan", "uscentral", "intercontinental"])
def test_on_the_paper_fleets_kafila_is_the_exact_optimum_up_to_the_head_margin(fleet_name):
    fleet = parse_fleet((FLEETS / f"{fleet_name}.toml").read_text())
    for model in ("qwen3-8b", "qwen3-14b", "qwen3-32b"):
        manifest = resolve_manifest(model)
        w = Workload.of(manifest, fleet.context, fleet.concurrency)
        best = exact_division(w.n_blocks, costs_for(fleet.devices, w, Tier.FULL))
        kw = {"context": fleet.context, "concurrency": fleet.concurrency, "objective": "bottleneck"}
        exact0, shipped = plan(fleet.devices, manifest, mu=0.0, **kw), plan(fleet.devices, manifest, **kw)
        if best is None:
            assert not exact0.feasible and not shipped.feasible
            continue
        assert close(exact0.bottleneck_s, best.bottleneck)
        assert best.bottleneck <= shipped.bottleneck_s <= best.bottleneck / (1 - MU)
