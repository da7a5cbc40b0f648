"""Prometheus metrics of the rendezvous (prefix `kafila_rendezvous_`), read from the pure cores.

The registry and relay keep plain counters; this collector turns them into metrics at scrape
time, so forwarding a packet costs no metric lock.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import kafila
from kafila.rendezvous.registry import Registry

PREFIX = "kafila_rendezvous_"
JOIN_OUTCOMES = (
    "ok",
    "unknown_session",
    "bad_code",
    "rate_limited",
    "session_full",
    "already_in_session",
    "wrong_secret",  # signaling v2: a proof of the secret that did not match
    "no_challenge",
    "not_ready",
    "rejoined",  # a member of a re-opened session took its place back (rejoin)
    "member_present",
    "unknown_member",
    "not_reopened",  # a rejoin before the host re-opened its session after a restart (the member retries)
)
LEAVE_REASONS = ("left", "timed_out", "disconnected", "removed")


class RendezvousCollector(Collector):
    def __init__(self, registry: Registry, udp_stats: dict[str, int] | None = None) -> None:
        self.registry = registry
        self.udp_stats = udp_stats if udp_stats is not None else {}

    def collect(self) -> Iterator[Metric]:
        reg, relay = self.registry, self.registry.relay
        build = GaugeMetricFamily(PREFIX + "build_info", "Always 1: the Kafila version", labels=["version"])
        build.add_metric([kafila.__version__], 1)
        yield build
        yield GaugeMetricFamily(PREFIX + "sessions", "Open sessions", value=len(reg.sessions))
        yield GaugeMetricFamily(PREFIX + "members", "Members in open sessions", value=reg.member_count)
        yield GaugeMetricFamily(PREFIX + "connections", "Signaling connections", value=len(reg.conns))
        joins = CounterMetricFamily(PREFIX + "joins", "Join attempts by outcome", labels=["outcome"])
        for outcome in sorted(set(JOIN_OUTCOMES) | set(reg.joins)):
            joins.add_metric([outcome], reg.joins.get(outcome, 0))
        yield joins
        left = CounterMetricFamily(
            PREFIX + "members_left", "Members gone from their session by reason", labels=["reason"]
        )
        for reason in sorted(set(LEAVE_REASONS) | set(reg.left)):
            left.add_metric([reason], reg.left.get(reason, 0))
        yield left
        yield GaugeMetricFamily(
            PREFIX + "relay_channels", "Allocated relay channels", value=len(relay.channels)
        )
        yield GaugeMetricFamily(
            PREFIX + "relay_channels_limit",
            "Relay channels this rendezvous allocates at most, all sessions together (0: it does not relay)",
            value=reg.limits.relay_channels,
        )
        yield CounterMetricFamily(
            PREFIX + "relay_bytes", "Bytes forwarded by the relay", value=relay.totals.bytes
        )
        yield CounterMetricFamily(
            PREFIX + "relay_packets", "Datagrams forwarded by the relay", value=relay.totals.packets
        )
        yield CounterMetricFamily(
            PREFIX + "relay_channels_recovered",
            "Relay channels from before a restart taken back from their signed tokens",
            value=relay.totals.recovered,
        )
        dropped = CounterMetricFamily(PREFIX + "relay_dropped", "Relay datagrams dropped", labels=["reason"])
        for why, count in relay.totals.dropped.items():
            dropped.add_metric([why.value], count)
        yield dropped
        probes = CounterMetricFamily(
            PREFIX + "udp_datagrams", "UDP datagrams received by kind", labels=["kind"]
        )
        for kind, count in sorted(self.udp_stats.items()):
            probes.add_metric([kind], count)
        yield probes


def make_registry(registry: Registry, udp_stats: dict[str, int] | None = None) -> CollectorRegistry:
    """A Prometheus registry of its own (several rendezvous apps can live in one process)."""
    prom = CollectorRegistry(auto_describe=False)
    prom.register(RendezvousCollector(registry, udp_stats))
    ProcessCollector(registry=prom)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
    return prom
