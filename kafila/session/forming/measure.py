"""What a member offers the session: its own device, measured."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from kafila.models.config import ConfigError, ModelConfig
from kafila.net.classify import NatReport
from kafila.obs import metrics
from kafila.planner.cost import fmt_bytes
from kafila.planner.devices import DeviceReport
from kafila.probe.measure import ProbeReport, probe
from kafila.session.progress import say
from kafila.session.terms import Options


class Measurements:
    """This member's probe results by the terms they ran under (backend, formats, pace, model
    shape): a spare that joins its lost host's successor under the same terms seconds later is not
    measured again (at --emulate-speed 0.05 a probe takes minutes)."""

    def __init__(self) -> None:
        self._by_terms: dict[str, tuple[ProbeReport, float]] = {}

    def get(self, terms: str) -> tuple[ProbeReport, float] | None:
        """The report measured under `terms` and how many seconds ago, if any."""
        got = self._by_terms.get(terms)
        return None if got is None else (got[0], time.monotonic() - got[1])

    def put(self, terms: str, report: ProbeReport) -> None:
        self._by_terms[terms] = (report, time.monotonic())


def probe_report(
    name: str,
    nat_report: NatReport | None,
    opts: Options,
    config: dict[str, Any] | None = None,
    measured: Measurements | None = None,
) -> DeviceReport:
    """This member measured (kafila.probe), or its measurement under the same terms from
    `measured`. With the session model's config.json the probe also times one decode step of one
    synthetic block of that model, which the planner prefers."""
    terms = json.dumps(
        [opts.backend, opts.dtype, opts.quant, opts.probe_repeats, opts.pace.speed, opts.model, config],
        sort_keys=True,
    )
    earlier = measured.get(terms) if measured is not None else None
    if earlier is not None:
        report, ago = earlier
        say(f"{name}: measured {ago:.0f} s ago for this model and format; offering that measurement")
    else:
        report = _measure(name, opts, config)
        if measured is not None:
            measured.put(terms, report)
    nat = nat_report.nat if nat_report else None
    rtt = nat_report.rtt_median if nat_report else None
    device = report.device_report(name, nat=nat, rtt_s=rtt)
    device = capped(device, opts.memory_bytes)
    say(
        f"{name}: {report.bandwidth.median / 1e9:.1f} GB/s, {fmt_bytes(device.memory_bytes)} for weights, "
        f"NAT {nat.cls if nat else 'unknown'}"
    )
    return device


def _measure(name: str, opts: Options, config: dict[str, Any] | None) -> ProbeReport:
    say("measuring this device (memory bandwidth, dispatch overhead, memory, one block of the model)")
    try:
        model = ModelConfig.from_dict(config) if config else None
    except (ConfigError, ValueError, TypeError):
        model = None
    pace = opts.pace
    if pace.emulated:
        say(f"{name}: emulating a slower device, {pace.speed:g} of this machine's speed (--emulate-speed)")
    return probe(
        opts.backend,
        opts.dtype,
        repeats=opts.probe_repeats,
        model=model,
        model_name=opts.model,
        pace=pace,
        quant="none" if opts.quant == "auto" else opts.quant,  # a member of an older host: floats
    )


def capped(device: DeviceReport, offered: int | None) -> DeviceReport:
    """The report offering at most `offered` bytes (--memory-gb): a cap, never more than measured."""
    if offered is None:
        return device
    if offered > device.memory_bytes:
        say(
            f"{device.name}: --memory-gb {offered / 1e9:g} is more than this device has for weights "
            f"({device.memory_bytes / 1e9:.1f} GB): offering {device.memory_bytes / 1e9:.1f} GB"
        )
        return device
    return DeviceReport.from_dict({**device.to_dict(), "memory_bytes": offered})


def observe_nats(devices: Iterable[DeviceReport]) -> dict[str, tuple[str, str | None]]:
    """The NAT class and mapping behaviour of every device whose report has them (what /session
    shows), each also exported as kafila_member_nat_info."""
    known: dict[str, tuple[str, str | None]] = {}
    for device in devices:
        if device.nat is None:
            continue
        mapping = device.nat.mapping.value if device.nat.mapping else None
        metrics.observe_member_nat(device.name, device.nat.cls.value, mapping or "unknown")
        known[device.name] = (device.nat.cls.value, mapping)
    return known
