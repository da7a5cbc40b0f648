"""The planner's tie-break by what members hold (kafila.planner.fetching), against brute force."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kafila.models.manifest import Manifest
from kafila.models.presets import resolve_manifest
from kafila.planner import DeviceReport, plan
from kafila.planner.cost import Tier, Workload, costs_for
from kafila.planner.fetching import HELD_MARGIN, Holdings, after_plan, fetching, holdings_of
from kafila.planner.held import Held
from kafila.planner.plan import Plan
from kafila.planner.replan import Membership, PlanTerms, Replan, on_lost

QWEN8 = resolve_manifest("qwen3-8b")
GB = 10**9


def dev(name: str, mem_gb: float, bw_gb_s: float, held: Held | None = None) -> DeviceReport:
    return DeviceReport(name, int(mem_gb * GB), bw_gb_s * 1e9, overhead_s=1e-4, held=held)


def stages(p: Plan) -> list[tuple[str, int, int, bool]]:
    return [(s.name, s.start, s.stop, s.head) for s in p.stages]


def probed_per_token(p: Plan, devices: list[DeviceReport], m: Manifest) -> float:
    """The plan's time per token from the probed stage costs (as divisions are chosen)."""
    w = Workload.of(m, p.context, p.concurrency)
    by_name = {d.name: c for d, c in zip(devices, costs_for(devices, w, Tier.FULL, True), strict=True)}
    stage_s = [by_name[s.name].stage_s(s.n_blocks, s.head) for s in p.stages]
    return max(max(stage_s), sum(stage_s) / p.concurrency)


def test_a_newcomer_in_a_lost_members_place_gets_blocks_others_hold() -> None:
    """A session of alpha (the host: the head and blocks 0-9), beta (10-22) and gamma (23-35); each
    joiner kept the next member's share, so beta holds 10-35 and gamma held the head and 0-9. gamma
    is replaced by an empty cache that probed 10% faster: without holdings the plan hands the
    newcomer block 9, which only the lost gamma held besides the host; with them, nothing comes
    from the host and the newcomer's blocks come from beta."""
    fleet = [
        dev("alpha", 12, 100, Held()),
        dev("new", 12, 110, Held()),
        dev("beta", 12, 100, Held(frozenset(range(10, 36)))),
    ]
    fastest = plan(fleet, QWEN8, context=4096)
    placed = plan(fleet, QWEN8, context=4096, weights_host="alpha")
    held = holdings_of(fleet, "alpha")
    assert held is not None
    assert (
        fastest.stage("new").start < 10 and fetching(fastest, held, QWEN8).host_bytes == QWEN8.block_bytes[9]
    )
    assert placed.host_bytes == 0 and placed.peer_bytes is not None and placed.peer_bytes > 0
    new = placed.stage("new")
    assert not new.head and 10 <= new.start < new.stop <= 36
    assert probed_per_token(placed, fleet, QWEN8) <= probed_per_token(fastest, fleet, QWEN8) * (
        1 + HELD_MARGIN
    )
    assert any(n.startswith("placed by what members hold: 0.0 MB from the host") for n in placed.notes)
    assert placed.summary()["host_bytes"] == 0


def test_without_holdings_the_plan_is_the_one_without_the_tie_break() -> None:
    fleet = [dev("alpha", 12, 100), dev("beta", 12, 140), dev("gamma", 12, 120)]
    bare = plan(fleet, QWEN8, context=4096)
    assert plan(fleet, QWEN8, context=4096, weights_host="alpha") == bare  # nothing reported
    empty = [replace(d, held=Held()) for d in fleet]
    assert plan(empty, QWEN8, context=4096, weights_host="alpha") == bare
    only_host = [replace(fleet[0], held=Held(frozenset(range(36)), True)), *empty[1:]]
    assert plan(only_host, QWEN8, context=4096, weights_host="alpha") == bare
    assert plan(empty, QWEN8, context=4096) == bare  # no host named
    assert bare.host_bytes is None and "host_bytes" not in bare.to_dict()


def test_the_plan_chosen_anyway_stays_when_it_fetches_least() -> None:
    """Every member holds everything: every plan fetches nothing, so the fastest stays."""
    everything = Held(frozenset(range(36)), True)
    fleet = [
        dev("alpha", 12, 100, everything),
        dev("beta", 12, 140, everything),
        dev("gamma", 12, 120, everything),
    ]
    bare = plan([replace(d, held=None) for d in fleet], QWEN8, context=4096)
    got = plan(fleet, QWEN8, context=4096, weights_host="alpha")
    assert stages(got) == stages(bare) and got.notes == bare.notes
    assert (got.host_bytes, got.peer_bytes) == (0, 0)


def test_held_round_trips_through_the_report_and_refuses_bad_runs() -> None:
    d = dev("beta", 12, 100, Held(frozenset([*range(3, 9), 12]), True))
    text = d.to_json()
    assert '"blocks": [[3, 9], [12, 13]]' in text
    assert DeviceReport.from_json(text) == d
    assert "held" not in dev("old", 12, 100).to_dict()  # an older host reads the report unchanged
    for bad in ({"blocks": [[5, 3]]}, {"blocks": [[0, 1, 2]]}, {"blocks": "0-3"}, [1, 2]):
        with pytest.raises(ValueError):
            Held.from_dict(bad)


def test_after_plan_adds_each_share_and_the_next_members_replica() -> None:
    fleet = [dev("alpha", 12, 100, Held()), dev("beta", 12, 100, Held(frozenset([0]))), dev("gamma", 12, 100)]
    p = plan(fleet, QWEN8, context=4096)
    after = {r.name: r.held for r in after_plan(fleet, p)}
    b, g = p.stage("beta"), p.stage("gamma")
    assert after["gamma"] is None  # did not report: stays unknown
    assert after["beta"] == Held(frozenset({0, *range(b.start, b.stop), *range(g.start, g.stop)}), False)


# -- against brute force ------------------------------------------------------------------------------

K = 7  # blocks of the small model below


def small_manifest(block_bytes: tuple[int, ...]) -> Manifest:
    return Manifest("llama", K, block_bytes, 3_000_000, 2_000_000, 1000, "F32")


def divisions(k: int, m: int) -> list[tuple[int, ...]]:
    """Every way to give m members at least one of k blocks, in chain order."""
    return [
        tuple(b - a for a, b in zip((0, *cuts), (*cuts, k), strict=True))
        for cuts in itertools.combinations(range(1, k), m - 1)
    ]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[DeviceReport], Manifest, int]:
    m = draw(st.integers(2, 4))
    block_bytes = tuple(
        draw(st.lists(st.integers(1, 4).map(lambda x: x * 1_000_000), min_size=K, max_size=K))
    )
    devices = []
    for i in range(m):
        held = draw(
            st.one_of(st.none(), st.builds(Held, st.frozensets(st.integers(0, K - 1)), st.booleans()))
        )
        bw = draw(st.sampled_from([50, 80, 100, 120, 200]))
        devices.append(DeviceReport(f"m{i}", 10**9, bw * 1e6, overhead_s=1e-4, held=held))
    return devices, small_manifest(block_bytes), draw(st.integers(1, 4))


@settings(max_examples=150, deadline=None)
@given(fleets())
def test_the_tie_break_is_the_least_host_bytes_within_the_margin(
    case: tuple[list[DeviceReport], Manifest, int],
) -> None:
    """Never slower than the margin allows; the fewest host bytes (then bytes fetched) of every
    head and division within it (every one tried); the same plan as without holdings when none
    beats it."""
    devices, manifest, u = case
    host = devices[0].name
    bare = plan(devices, manifest, context=64, concurrency=u)
    got = plan(devices, manifest, context=64, concurrency=u, weights_host=host)
    held = holdings_of(devices, host)
    if held is None or not bare.feasible:
        event("nothing held by members other than the host, or no plan")
        assert stages(got) == stages(bare)
        return
    event("placed by holdings" if stages(got) != stages(bare) else "the fastest plan fetches least")
    limit = probed_per_token(bare, devices, manifest) * (1 + HELD_MARGIN)
    assert probed_per_token(got, devices, manifest) <= limit * (1 + 1e-9)
    best = min(_objective(p, held, manifest) for p in _within(bare, devices, manifest, limit * (1 + 1e-9)))
    assert _objective(got, held, manifest) == best
    if _objective(bare, held, manifest) == best:
        assert stages(got) == stages(bare)


def _objective(p: Plan, h: Holdings, manifest: Manifest) -> tuple[int, int]:
    f = fetching(p, h, manifest)
    return f.host_bytes, f.host_bytes + f.peer_bytes


def _within(bare: Plan, devices: list[DeviceReport], manifest: Manifest, limit: float) -> list[Plan]:
    """Every head and division of `bare`'s ring that fits and is within `limit` (probed)."""
    m, out = len(bare.order), []
    ring = list(bare.order)  # any rotation is the same ring
    by_name = {d.name: d for d in devices}
    w = Workload.of(manifest, bare.context, bare.concurrency)
    for r in range(m):
        chain = ring[r:] + ring[:r]
        for counts in divisions(manifest.n_blocks, m):
            start, stage_list = 0, []
            for j, (name, n) in enumerate(zip(chain, counts, strict=True)):
                d = by_name[name]
                if w.resident_bytes(n, j == 0) > d.memory_bytes:
                    break
                stage_list.append(
                    replace(bare.stages[0], name=name, start=start, stop=start + n, head=j == 0)
                )
                start += n
            else:
                p = replace(bare, order=tuple(chain), head=chain[0], stages=tuple(stage_list))
                if probed_per_token(p, devices, manifest) <= limit:
                    out.append(p)
    return out


def test_a_replan_after_a_loss_moves_fewer_bytes_by_what_the_plans_left_on_disk() -> None:
    """Members that reported their caches (empty at first) hold, after forming, their shares and
    the next member's: losing one, the re-plan fetches nothing from the host (every block of the
    lost member is on its predecessor's disk) and no more bytes in all than the plan without
    holdings, and is exactly plan() over the survivors as the membership holds them."""
    fleet = [
        dev("host", 12, 100, Held()),
        dev("b", 12, 200, Held()),
        dev("c", 12, 150, Held()),
        dev("d", 12, 120, Held()),
    ]
    first = plan(fleet, QWEN8, context=4096, weights_host="host")
    assert first.host_bytes is None  # nothing held yet: the fastest plan
    m = Membership(0, first, after_plan(fleet, first), frozenset(d.name for d in fleet), "host")
    got = on_lost(m, "c", "silent for 3.0 s", QWEN8, PlanTerms(context=4096))
    assert isinstance(got, Replan)
    survivors = [r for r in m.reports if r.name != "c"]
    want = plan(survivors, QWEN8, context=4096, anchor=0, keep_head=True, weights_host="host")
    assert got.plan == want and want.host_bytes == 0
    bare = plan(survivors, QWEN8, context=4096, anchor=0, keep_head=True)
    held = holdings_of(survivors, "host")
    assert held is not None
    assert got.plan.peer_bytes is not None
    assert (
        got.plan.peer_bytes <= fetching(bare, held, QWEN8).peer_bytes + fetching(bare, held, QWEN8).host_bytes
    )
