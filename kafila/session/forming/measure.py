"""What a member offers the session: its own device, measured."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kafila import __version__
from kafila.engine import system
from kafila.models.config import ConfigError, ModelConfig
from kafila.net.classify import NatReport
from kafila.obs import metrics
from kafila.planner.cost import fmt_bytes
from kafila.planner.devices import DeviceReport
from kafila.probe.measure import ProbeReport, memory_now, probe
from kafila.session.progress import say
from kafila.session.terms import Options
from kafila.session.weights.cache import cache_root, write_atomic

MEASURED_FILE = "measured.json"  # in the weight cache's folder: this machine's own latest measurements


class Measurements:
    """This member's probe results by the terms they ran under (backend, formats, pace, model
    shape, and the machine: CPU model, CPUs it may run on, CPU quota, kafila's version). In memory
    for as long as the process lives: a spare that joins its lost host's successor under the same
    terms seconds later is not measured again (at --emulate-speed 0.05 a probe takes minutes). With
    a `folder`, also on disk, where a member started again on this machine (a restart, the next
    session) offers a measurement at most `max_age_s` old instead of measuring for 10-60 s. The
    memory figure is always read again: what is free changes with what else runs."""

    def __init__(self, folder: Path | None = None, max_age_s: float = 0.0) -> None:
        self._by_terms: dict[str, tuple[ProbeReport, float]] = {}
        self.folder, self.max_age_s = folder, max_age_s

    def get(self, terms: str, now: float) -> tuple[ProbeReport, float] | None:
        """The report measured under `terms` and how many seconds before `now` (wall clock), if any."""
        got = self._by_terms.get(terms) or self._on_disk(terms, now)
        return None if got is None else (got[0], max(0.0, now - got[1]))

    def put(self, terms: str, report: ProbeReport, now: float) -> None:
        self._by_terms[terms] = (report, now)
        if self.folder is None or self.max_age_s <= 0:
            return
        kept = {k: v for k, v in self._read().items() if now - float(v.get("at", 0)) <= self.max_age_s}
        kept[terms] = {"at": now, "report": report.to_dict()}
        with contextlib.suppress(OSError):  # a read-only cache: measured again next time, nothing lost
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(self.folder / MEASURED_FILE, [json.dumps(kept).encode()], durable=False)

    def _on_disk(self, terms: str, now: float) -> tuple[ProbeReport, float] | None:
        if self.max_age_s <= 0:
            return None
        entry = self._read().get(terms)
        if entry is None or not 0 <= now - float(entry["at"]) <= self.max_age_s:
            return None
        report = ProbeReport.from_dict(entry["report"])
        return dataclasses.replace(report, memory_bytes=memory_now(report.backend)), float(entry["at"])

    def _read(self) -> dict[str, dict[str, Any]]:
        if self.folder is None:
            return {}
        try:
            got = json.loads((self.folder / MEASURED_FILE).read_text())
        except (OSError, ValueError):  # none yet, or damaged: measured again
            return {}
        return got if isinstance(got, dict) else {}


def own_measurements(opts: Options) -> Measurements:
    """A member's measurements, kept beside its weight cache (`--cache`) for `--probe-max-age`."""
    return Measurements(cache_root(opts.cache), opts.probe_max_age_s)


def measurement_terms(opts: Options, config: dict[str, Any] | None) -> str:
    """What a measurement depends on: the member's formats, pace and model shape, and the machine
    as this process sees it (CPU model, the CPUs it may use, its quota, the probe's version)."""
    return json.dumps(
        [opts.backend, opts.dtype, opts.quant, opts.probe_repeats, opts.pace.speed, opts.model, config,
         system.cpu_model(), sorted(os.sched_getaffinity(0)), system.cpu_quota(), system.usable_cpus(),
         __version__],
        sort_keys=True,
    )  # fmt: skip


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
    terms = measurement_terms(opts, config)
    pace = opts.pace
    if pace.emulated:  # it serves at that pace too, measured now or earlier
        say(f"{name}: emulating a slower device, {pace.speed:g} of this machine's speed (--emulate-speed)")
    earlier = measured.get(terms, time.time()) if measured is not None else None
    if earlier is not None:
        report, ago = earlier
        say(
            f"{name}: measured {ago:.0f} s ago under the same terms (model, format, CPUs); offering that "
            "measurement (--probe-max-age 0 measures again)"
        )
    else:
        report = _measure(name, opts, config)
        if measured is not None:
            measured.put(terms, report, time.time())
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
    return probe(
        opts.backend,
        opts.dtype,
        repeats=opts.probe_repeats,
        model=model,
        model_name=opts.model,
        pace=opts.pace,
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
