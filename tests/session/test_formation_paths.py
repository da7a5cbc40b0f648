"""The host's plan after what its own links measured (kafila.session.forming.plans.with_measured_paths):
an edge predicted direct that runs through the relay is re-priced before the plan is sent."""

from __future__ import annotations

from kafila.models.presets import resolve_manifest
from kafila.planner import DeviceReport, plan
from kafila.planner.reachability import Behaviour, Nat, NatClass
from kafila.session.forming.plans import with_measured_paths
from kafila.session.terms import Options

QWEN8 = resolve_manifest("qwen3-8b")
OPTS = Options(context=4096, members=3)
PORT_RESTRICTED = Nat(NatClass.ORDINARY, Behaviour.ENDPOINT_INDEPENDENT, Behaviour.ADDRESS_AND_PORT_DEPENDENT)


def fleet(rtt_s: float, pair_rtt_s: float, bw: float) -> list[DeviceReport]:
    names = ["host", "b", "c", "d"]
    return [
        DeviceReport(
            n,
            24 * 10**9,
            bw,
            overhead_s=1e-4,
            nat=PORT_RESTRICTED,
            rtt_s=rtt_s,
            pair_rtt_s={o: pair_rtt_s for o in names if o != n and "host" in (n, o)},
        )
        for n in names
    ]


def planned(devices: list[DeviceReport]):  # type: ignore[no-untyped-def]
    return plan(devices, QWEN8, context=OPTS.context, anchor=0)


def test_paths_that_agree_with_the_plan_leave_it_as_it_is() -> None:
    devices = fleet(0.002, 0.001, 100e9)
    p = planned(devices)
    assert with_measured_paths(p, devices, {("host", p.order[1]): True}, QWEN8, OPTS, "host") is p


def test_a_relayed_host_edge_keeps_the_ring_and_the_plan_says_relay_and_its_cost() -> None:
    devices = fleet(0.002, 0.001, 50e9)  # relaying costs little next to slow stages
    p = planned(devices)
    peer = p.order[1]
    got = with_measured_paths(p, devices, {("host", peer): False}, QWEN8, OPTS, "host")
    assert got.order == p.order and got.stages == p.stages
    edge = next(e for e in got.edges if {e.src, e.dst} == {"host", peer})
    assert edge.direct is False and edge.latency_s == (0.002 + 0.002) / 2  # through the rendezvous
    assert got.per_token_s is not None and p.per_token_s is not None and got.per_token_s > p.per_token_s


def test_a_relayed_host_edge_that_another_order_avoids_is_replanned_before_the_plan_is_sent() -> None:
    devices = fleet(0.1, 0.002, 1000e9)  # far from the rendezvous, fast stages: a relay costs 200 ms
    p = planned(devices)
    peer = p.order[1]
    got = with_measured_paths(p, devices, {("host", peer): False}, QWEN8, OPTS, "host")
    assert got.order != p.order
    assert all({e.src, e.dst} != {"host", peer} for e in got.edges)
    assert got.per_token_s is not None and p.per_token_s is not None
    assert got.per_token_s <= p.per_token_s * 1.0001  # as good as the plan that believed the edge direct
