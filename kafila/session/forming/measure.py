"""What a member offers the session: its own device, measured."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kafila.models.config import ConfigError, ModelConfig
from kafila.net.edge import LinkNode
from kafila.obs import metrics
from kafila.planner.cost import fmt_bytes
from kafila.planner.devices import DeviceReport
from kafila.probe.measure import probe
from kafila.session.progress import say
from kafila.session.terms import Options


def probe_report(
    name: str, node: LinkNode, opts: Options, config: dict[str, Any] | None = None
) -> DeviceReport:
    """This member measured (kafila.probe). With the session model's config.json the probe also
    times one decode step of one synthetic block of that model, which the planner prefers."""
    say("measuring this device (memory bandwidth, dispatch overhead, memory, one block of the model)")
    try:
        model = ModelConfig.from_dict(config) if config else None
    except (ConfigError, ValueError, TypeError):
        model = None
    pace = opts.pace
    if pace.emulated:
        say(f"{name}: emulating a slower device, {pace.speed:g} of this machine's speed (--emulate-speed)")
    report = probe(
        opts.backend,
        opts.dtype,
        repeats=opts.probe_repeats,
        model=model,
        model_name=opts.model,
        pace=pace,
        quant="none" if opts.quant == "auto" else opts.quant,  # a member of an older host: floats
    )
    nat = node.nat.nat if node.nat else None
    rtt = node.nat.rtt_median if node.nat else None
    device = report.device_report(name, nat=nat, rtt_s=rtt)
    device = capped(device, opts.memory_bytes)
    say(
        f"{name}: {report.bandwidth.median / 1e9:.1f} GB/s, {fmt_bytes(device.memory_bytes)} for weights, "
        f"NAT {nat.cls if nat else 'unknown'}"
    )
    return device


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
