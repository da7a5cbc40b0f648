"""The planner end to end: tiers, admission refusals, baselines, the paper's fleets, Plan JSON."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kafila.models.presets import resolve_manifest
from kafila.planner import DeviceReport, Plan, plan, plan_all
from kafila.planner.admission import fits
from kafila.planner.cost import Workload
from kafila.planner.fleet import parse_fleet

FLEETS = Path(__file__).resolve().parents[2] / "examples" / "fleets"
QWEN8 = resolve_manifest("qwen3-8b")
GB = 10**9


def gpu(name: str, mem_gb: float, bw_gb_s: float | None, **kw) -> DeviceReport:
    return DeviceReport(name, int(mem_gb * GB), None if bw_gb_s is None else bw_gb_s * 1e9, **kw)


def test_full_tier_prices_blocks_by_bandwidth_and_places_the_head():
    fleet = [gpu("slow", 40, 100, overhead_s=1e-4), gpu("fast", 40, 400, overhead_s=1e-4)]
    p = plan(fleet, QWEN8, context=4096, concurrency=1)
    assert p.feasible and p.tier == "full"
    assert p.blocks()["fast"] > 3 * p.blocks()["slow"] - 4
    assert sum(p.blocks().values()) == 36
    assert p.order[0] == p.head and p.stages[0].head
    assert [s.start for s in p.stages] == [0, p.stages[0].stop]
    w = Workload.of(QWEN8, 4096, 1)
    for s in p.stages:
        b = 100e9 if s.name == "slow" else 400e9
        want = 1e-4 + s.n_blocks * w.block_read_bytes / b + (w.head_read_bytes / b if s.head else 0)
        assert s.cost_s == pytest.approx(want)
    assert p.bottleneck_s == max(s.cost_s for s in p.stages)
    assert p.utilisation == pytest.approx(sum(s.cost_s for s in p.stages) / 2 / p.bottleneck_s)


def test_synthetic_block_probe_replaces_the_bandwidth_per_block_cost():
    fleet = [gpu("a", 40, 100, block_s=0.001), gpu("b", 40, 100, block_s=0.003)]
    p = plan(fleet, QWEN8, context=4096)
    assert p.blocks()["a"] > 2 * p.blocks()["b"]
    off = plan(fleet, QWEN8, context=4096, use_block_probe=False)
    other = "b" if off.head == "a" else "a"
    # equal bandwidths: only the head read (1.24 GB, about 3.2 blocks) separates the two shares
    assert 0 < off.blocks()[other] - off.blocks()[off.head] <= 4


def test_block_dispatch_adds_to_the_bandwidth_per_block_cost_and_the_block_probe_replaces_both():
    w = Workload.of(QWEN8, 4096, 1)
    fleet = [replace(gpu("a", 40, 100), block_dispatch_s=0.002), gpu("b", 40, 100)]
    p = plan(fleet, QWEN8, context=4096)
    a = next(s for s in p.stages if s.name == "a")
    want = a.n_blocks * (w.block_read_bytes / 100e9 + 0.002) + (w.head_read_bytes / 100e9 if a.head else 0)
    assert a.cost_s == pytest.approx(want)
    assert p.blocks()["a"] < p.blocks()["b"]  # the dispatch term makes a slower per block
    timed = plan([replace(fleet[0], block_s=0.001), fleet[1]], QWEN8, context=4096)
    a = next(s for s in timed.stages if s.name == "a")
    assert a.cost_s == pytest.approx(a.n_blocks * 0.001 + (w.head_read_bytes / 100e9 if a.head else 0))


def test_probed_head_time_replaces_the_head_read_over_bandwidth():
    w = Workload.of(QWEN8, 4096, 1)
    fleet = [gpu("a", 40, 100, block_s=0.001, head_s=0.002), gpu("b", 40, 100, block_s=0.001, head_s=0.05)]
    p = plan(fleet, QWEN8, context=4096)
    assert p.head == "a"  # b's head would cost 50 ms, a's 2 ms
    a = next(s for s in p.stages if s.name == "a")
    assert a.cost_s == pytest.approx(a.n_blocks * 0.001 + 0.002)
    off = plan(fleet, QWEN8, context=4096, use_block_probe=False)
    h = next(s for s in off.stages if s.head)
    assert h.cost_s == pytest.approx(h.n_blocks * w.block_read_bytes / 100e9 + w.head_read_bytes / 100e9)
    assert DeviceReport.from_json(fleet[1].to_json()) == fleet[1]


def test_probed_stage_fixed_part_replaces_the_dispatch_overhead_where_blocks_are_probed():
    fleet = [gpu("a", 40, 100, overhead_s=1e-4, block_s=0.001, head_s=0.002, stage_fixed_s=0.003)]
    a = plan(fleet, QWEN8, context=4096).stages[0]
    assert a.cost_s == pytest.approx(0.003 + a.n_blocks * 0.001 + 0.002)
    off = plan(fleet, QWEN8, context=4096, use_block_probe=False).stages[0]  # bandwidth form: o_i
    w = Workload.of(QWEN8, 4096, 1)
    by_bandwidth = off.n_blocks * w.block_read_bytes / 100e9 + w.head_read_bytes / 100e9
    assert off.cost_s == pytest.approx(1e-4 + by_bandwidth)
    assert DeviceReport.from_json(fleet[0].to_json()) == fleet[0]
    with pytest.raises(ValueError, match="stage_fixed_s must be >= 0"):
        gpu("b", 40, 100, stage_fixed_s=-1.0)


def test_a_stage_idle_longer_than_the_probe_timed_it_is_predicted_with_its_wake_up():
    """Each step after about twice its own length of idle, as the probe timed it, costs c_i; after
    the gap the division leaves (time per token less its own step) it costs what the probe's wake
    figure adds on top. The division is chosen on c_i alone."""
    from kafila.planner.cost import wake_cost_s

    w, tau = 0.0005, 0.008
    fleet = [
        gpu("big", 40, 100, block_s=0.001, head_s=0.002, stage_fixed_s=0.0, wake_s=w, wake_tau_s=tau),
        gpu("small", 40, 100, block_s=0.004, stage_fixed_s=0.0, wake_s=w, wake_tau_s=tau),
    ]
    plain = plan([replace(d, wake_s=None, wake_tau_s=None) for d in fleet], QWEN8, context=4096)
    woken = plan(fleet, QWEN8, context=4096)
    assert woken.blocks() == plain.blocks()
    per_token = plain.per_token_s  # one request: the circuit
    for before, after in zip(plain.stages, woken.stages, strict=True):
        c = before.cost_s
        extra = wake_cost_s(w, tau, per_token - c) - wake_cost_s(w, tau, 2 * c)
        assert after.cost_s == pytest.approx(c + max(0.0, extra))
    small = woken.stage("small")
    assert small.cost_s > plain.stage("small").cost_s + 0.2 * w  # idles through most of the circuit
    assert woken.circuit_s == pytest.approx(sum(s.cost_s for s in woken.stages))
    [note] = [n for n in woken.notes if "cannot keep" in n]  # the plan's circuit, wake-ups included
    assert (
        f"short circuit ({woken.circuit_s * 1e3:.1f} ms, slowest stage {woken.bottleneck_s * 1e3:.1f} ms)"
        in note
    )
    assert DeviceReport.from_json(fleet[0].to_json()) == fleet[0]
    with pytest.raises(ValueError, match="wake_s must be >= 0"):
        gpu("b", 40, 100, wake_s=-1.0)
    with pytest.raises(ValueError, match="wake_tau_s must be > 0"):
        gpu("b", 40, 100, wake_s=1e-4, wake_tau_s=0.0)


def test_a_busy_ring_pays_no_wake_up():
    """Enough requests in flight that every stage works through the bottleneck's period: the gaps
    are no longer than the probe's, so the stage times are the probed costs."""
    fleet = [
        gpu(n, 40, 100, block_s=0.001, head_s=0.001, stage_fixed_s=0.0, wake_s=0.001, wake_tau_s=0.008)
        for n in ("a", "b", "c")
    ]
    plain = plan([replace(d, wake_s=None) for d in fleet], QWEN8, context=4096, concurrency=8)
    busy = plan(fleet, QWEN8, context=4096, concurrency=8)
    assert [s.cost_s for s in busy.stages] == [s.cost_s for s in plain.stages]


def test_throughput_tier_when_a_bandwidth_is_missing_keeps_the_head_with_the_opener():
    fleet = [gpu("opener", 40, None, flops=1e12), gpu("big", 40, 900, flops=9e12)]
    p = plan(fleet, QWEN8, context=4096)
    assert p.tier == "throughput" and p.head == "opener"
    assert p.blocks()["big"] > 5 * p.blocks()["opener"]
    assert p.stages[0].cost_s == pytest.approx(p.stages[0].n_blocks * 2 * QWEN8.block_bytes[0] / 2 / 1e12)


def test_throughput_tier_refuses_when_the_opener_cannot_hold_the_head():
    fleet = [gpu("opener", 2.5, None, flops=1e12), gpu("big", 40, 900, flops=9e12)]
    p = plan(fleet, QWEN8, context=4096)
    assert not p.feasible and p.reason.startswith(
        "the head stays with the opener in this tier: opener: 1 block"
    )


def test_a_single_member_holds_everything_and_has_no_edges():
    p = plan([gpu("solo", 40, 100, overhead_s=1e-4)], QWEN8, context=4096)
    assert p.feasible and p.order == ("solo",) and p.edges == () and p.blocks() == {"solo": 36}
    assert p.circuit_s == p.bottleneck_s and p.network_priced and p.notes == ()


def test_notes_say_which_tier_and_ordering_applied():
    fleet = [gpu("a", 30, None, flops=1e12), gpu("b", 10, None, flops=1e12)]
    notes = plan(fleet, QWEN8, context=1024).notes
    assert notes[0].startswith("throughput tier") and notes[1].startswith("ring ordered by the NAT counting")


def test_working_set_tier_when_nothing_is_measured_divides_by_memory():
    fleet = [gpu("a", 30, None), gpu("b", 10, None, flops=1e12)]
    p = plan(fleet, QWEN8, context=1024)
    assert p.tier == "working_set" and p.feasible
    assert p.blocks() == {"a": 27, "b": 9}
    assert p.bottleneck_s is None and p.stages[0].cost_s is None


def test_refusal_names_the_undersized_device_and_the_numbers():
    fleet = [gpu("desktop", 80, 900), gpu("laptop", 6, 100)]
    p = plan(fleet, QWEN8, context=40960, concurrency=4, division="uniform")
    assert not p.feasible
    assert p.reason.startswith("laptop: 18 blocks need 19.0 GB, has 6.0 GB")
    assert "desktop" not in p.reason
    assert p.blocks() == {"desktop": 18, "laptop": 18}  # the refused division is still shown


def test_kafila_fits_where_the_baselines_are_refused():
    fleet = [gpu("desktop", 80, 900), gpu("laptop", 6, 100)]
    p = plan(fleet, QWEN8, context=40960, concurrency=4)
    assert p.feasible and p.blocks()["laptop"] <= 5


def test_memory_division_gives_every_member_a_block_however_unequal_their_memory():
    """proportional_counts used to take the block it had lifted a tiny share to back from that
    share: 0 blocks, "fits", and a zero-cost stage that divided by zero in the plan's figures."""
    fleet = [gpu("big", 100, 10, overhead_s=5e-5), gpu("s1", 0.5, 10), gpu("s2", 0.5, 10)]
    plans = plan_all(fleet, QWEN8, context=256)
    for p in plans.values():
        assert min(p.blocks().values()) >= 1, (p.division, p.blocks())
    assert plans["memory"].blocks()["big"] == 34


def test_no_division_names_the_device_that_cannot_hold_one_block():
    fleet = [gpu("desktop", 80, 900), gpu("phone", 0.3, 30)]
    p = plan(fleet, QWEN8, context=4096)
    assert not p.feasible and p.reason.startswith("phone: 1 block needs 402.7 MB")
    assert "has 300.0 MB" in p.reason


def test_fleet_too_small_for_the_model_lists_every_limit():
    fleet = [gpu("a", 8, 100), gpu("b", 8, 100)]
    p = plan(fleet, QWEN8, context=4096)
    assert (
        not p.feasible
        and "at most 32 of 36 blocks" in p.reason
        and "a 19 (13 with the head), b 19 (13 with the head)" in p.reason
    )


def test_a_fleet_short_of_memory_is_told_how_many_blocks_and_bytes_it_lacks():
    """The laptop can hold 2 blocks but not the head with one of its own, so only the desktop can
    hold the head: 13 + 2 = 15 blocks (the bound used to count the laptop holding the head with no
    block: 19)."""
    fleet = [gpu("desktop", 8, 900), gpu("laptop", 1.2, 100)]
    w = Workload.of(QWEN8, 4096, 1)
    per_block = w.block_resident_bytes
    assert [w.limit(d.memory_bytes, head) for d in fleet for head in (False, True)] == [19, 13, 2, 0]
    p = plan(fleet, QWEN8, context=4096)
    assert not p.feasible
    assert p.reason.startswith(
        "the members hold at most 15 of 36 blocks with the head (desktop holding it): "
        f"21 blocks more need {21 * per_block / 1e9:.1f} GB more memory "
        f"({per_block / 1e6:.1f} MB per block at context 4096 x concurrency 1; "
        "limits: desktop 19 (13 with the head), laptop 2 (0 with the head))"
    ), p.reason


def test_more_members_than_blocks_is_refused():
    p = plan([gpu(f"d{i}", 10, 100) for i in range(40)], QWEN8, context=128)
    assert not p.feasible and "40 members" in p.reason


def test_plan_json_round_trip():
    fleet = parse_fleet((FLEETS / "intercontinental.toml").read_text())
    for p in plan_all(
        fleet.devices, resolve_manifest(fleet.model), context=fleet.context, concurrency=4
    ).values():
        back = Plan.from_json(p.to_json())
        assert back == p
    p = plan(fleet.devices, resolve_manifest(fleet.model), context=fleet.context, concurrency=4)
    assert p.edges and not all(e.direct for e in p.edges) and p.network_priced
    assert p.circuit_s == pytest.approx(sum(s.cost_s for s in p.stages) + sum(e.latency_s for e in p.edges))
    assert p.block_range(p.head) == (0, p.stages[0].n_blocks)
    last = p.order[-1]
    assert p.successor(last) == p.head and p.predecessor(p.head) == last
    assert p.successor(p.head) == p.order[1] and p.stage(last).stop == 64
    with pytest.raises(KeyError, match="nobody"):
        p.stage("nobody")


def test_device_report_json_round_trip():
    fleet = parse_fleet((FLEETS / "lan.toml").read_text())
    for d in fleet.devices:
        d2 = replace(d, block_s=0.001, pair_rtt_s={"x": 0.002})
        assert DeviceReport.from_json(d2.to_json()) == d2


@pytest.mark.parametrize("fleet_file", ["lan.toml", "uscentral.toml", "intercontinental.toml"])
@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-14b", "qwen3-32b"])
@pytest.mark.parametrize("objective", ["load", "bottleneck"])
def test_on_the_paper_fleets_kafila_is_never_worse_than_the_baselines(fleet_file, model, objective):
    """...by what it minimizes: the bottleneck, or the time per token at the declared concurrency."""
    fleet = parse_fleet((FLEETS / fleet_file).read_text())
    plans = plan_all(
        fleet.devices,
        resolve_manifest(model),
        context=fleet.context,
        concurrency=fleet.concurrency,
        objective=objective,
    )
    kafila = plans["kafila"]
    key = "bottleneck_s" if objective == "bottleneck" else "per_token_s"
    for name in ("uniform", "memory"):
        base = plans[name]
        if base.feasible:
            assert kafila.feasible and getattr(kafila, key) <= getattr(base, key) * (1 + 1e-12)
    assert kafila.feasible or fleet_file == "lan.toml"  # 32B does not fit the LAN fleet at all


def test_the_paper_memory_walls():
    inter = parse_fleet((FLEETS / "intercontinental.toml").read_text())
    plans = plan_all(inter.devices, resolve_manifest("qwen3-32b"), context=40960, concurrency=4)
    assert plans["kafila"].feasible and not plans["uniform"].feasible
    assert plans["uniform"].reason.startswith("m3pro: 13 blocks need")
    lan = parse_fleet((FLEETS / "lan.toml").read_text())
    plans = plan_all(lan.devices, resolve_manifest("qwen3-14b"), context=40960, concurrency=4)
    assert not plans["uniform"].feasible and plans["uniform"].reason.startswith("a40: 10 blocks")


def test_a_fleet_short_of_memory_is_told_the_largest_context_and_concurrency_that_fit():
    """The KV reservation grows with the declared context and concurrency: the refusal says how far
    down either must go, each with the other as declared (the largest that fits, the next does not)."""
    fleet = [gpu("a", 12, 500), gpu("b", 12, 500)]
    p = plan(fleet, QWEN8, context=32768, concurrency=4)
    w = Workload.of(QWEN8, 32768, 4)
    assert not p.feasible and not fits(fleet, w)
    c = next(c for c in range(32767, 0, -1) if fits(fleet, w.at(c, 4)))
    assert 1000 < c < 32767 and fits(fleet, w.at(c, 4)) and not fits(fleet, w.at(c + 1, 4))
    assert fits(fleet, w.at(32768, 1)) and not fits(fleet, w.at(32768, 2))
    hint = f"; it fits with concurrency at most 1, or with context at most {c}"
    assert p.reason.endswith(f"{hint} (--concurrency, --context)"), p.reason
    assert plan(fleet, QWEN8, context=c, concurrency=4).feasible
    weights_short = plan([gpu("a", 8, 900), gpu("b", 1.2, 100)], QWEN8, context=4096).reason
    assert "it fits with" not in weights_short  # the weights alone do not fit: no context would
    assert Workload.of(QWEN8, 777, 3) == w.at(777, 3)


def test_in_the_throughput_tier_only_the_opener_counts_as_the_heads_holder():
    """The head stays with the opener in this tier: with `big` holding it these members would hold
    all 36 blocks, and the refusal said "at most 36 of 36 blocks ... (big holding it): 0 blocks more
    need 0 B" and a context that then did not fit either."""
    fleet = [gpu("opener", 4.2, None, flops=1e12), gpu("big", 14.9, None, flops=9e12)]
    p = plan(fleet, QWEN8, context=8192, concurrency=2)
    assert p.tier == "throughput" and not p.feasible
    assert p.reason.startswith(
        "the members hold at most 35 of 36 blocks with the head (opener holding it): 1 block more"
    )
    assert p.reason.endswith(
        "; it fits with concurrency at most 1, or with context at most 8010 (--concurrency, --context)"
    )
    assert plan(fleet, QWEN8, context=8010, concurrency=2).feasible
    assert not plan(fleet, QWEN8, context=8011, concurrency=2).feasible
    assert plan(fleet, QWEN8, context=8192, concurrency=1).feasible
