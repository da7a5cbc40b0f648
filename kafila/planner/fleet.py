"""Fleet files (`kafila plan FLEET.toml`): a session and its devices, validated field by field.

[session]
model = "qwen3-8b"        # preset name or a local Hugging Face folder
context = 32768           # declared context per request (tokens)
concurrency = 4           # concurrent requests the KV cache is reserved for

[[device]]                # the first device is the one that opened the session (the anchor)
name = "l40s"
memory_gb = 24            # memory available for weights and KV cache, 1 GB = 1e9 bytes
bandwidth_gb_s = 520.5    # optional: measured memory bandwidth
overhead_us = 40          # optional: per-token dispatch overhead
tflops = 362              # optional: matmul throughput (the degraded tier)
nat = "ordinary"          # optional: permissive | ordinary | restrictive
filtering = "address-dependent"   # optional RFC 4787 filtering detail
rtt_ms = 12               # optional: round trip to the rendezvous
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kafila.planner.devices import DeviceReport
from kafila.planner.reachability import Behaviour, Nat, NatClass


class FleetError(ValueError):
    """The fleet file is malformed; the message names the device and the field."""


@dataclass(frozen=True)
class Fleet:
    model: str
    context: int
    concurrency: int
    devices: tuple[DeviceReport, ...]


_SESSION_KEYS = {"model", "context", "concurrency"}
_DEVICE_KEYS = {
    "name", "memory_gb", "bandwidth_gb_s", "overhead_us", "tflops", "nat", "filtering", "rtt_ms", "probe",
}  # fmt: skip
ReadJson = Callable[[str], Any]


def parse_fleet(text: str, source: str = "fleet", read_json: ReadJson | None = None) -> Fleet:
    """Parse and validate a fleet. `read_json(path)` loads a device's `probe` file (the caller
    does the I/O, relative to the fleet file); without it a `probe` field is an error."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FleetError(f"{source}: not valid TOML: {exc}") from exc
    session = data.get("session")
    if not isinstance(session, dict):
        raise FleetError(f"{source}: needs a [session] table with model, context, concurrency")
    _no_unknown(session, _SESSION_KEYS, f"{source}: [session]")
    tables = data.get("device")
    if not isinstance(tables, list) or not tables:
        raise FleetError(f"{source}: needs at least one [[device]] table")
    model = _get(session, "model", str, f"{source}: [session]")
    devices = tuple(_device(t, i, source, model, read_json) for i, t in enumerate(tables))
    names = [d.name for d in devices]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise FleetError(f"{source}: device names must be unique, repeated: {dup}")
    return Fleet(
        model=model,
        context=_positive_int(session, "context", f"{source}: [session]"),
        concurrency=_positive_int(session, "concurrency", f"{source}: [session]", default=1),
        devices=devices,
    )


def _device(t: Any, index: int, source: str, model: str, read_json: ReadJson | None) -> DeviceReport:
    where = f"{source}: device #{index + 1}"
    if not isinstance(t, dict):
        raise FleetError(f"{where}: must be a table")
    name = _get(t, "name", str, where)
    where = f"{source}: device {name!r}"
    _no_unknown(t, _DEVICE_KEYS, where)
    measured = _probe_file(t, where, model, read_json)
    memory = _number(t, "memory_gb", where, required="memory_bytes" not in measured)
    bandwidth = _number(t, "bandwidth_gb_s", where)
    overhead = _number(t, "overhead_us", where, allow_zero=True)
    tflops = _number(t, "tflops", where)
    rtt = _number(t, "rtt_ms", where, allow_zero=True)
    given = {
        "memory_bytes": None if memory is None else int(memory * 1e9),
        "bandwidth_bytes_s": None if bandwidth is None else bandwidth * 1e9,
        "overhead_s": None if overhead is None else overhead * 1e-6,
        "flops": None if tflops is None else tflops * 1e12,
    }
    merged = measured | {k: v for k, v in given.items() if v is not None}
    if bandwidth is not None:  # an explicit bandwidth asks for bandwidth pricing, not the probed block
        for key in ("block_s", "head_s", "stage_fixed_s"):  # block_dispatch_s adds to bandwidth pricing
            merged.pop(key, None)
    return DeviceReport(
        name=name,
        memory_bytes=int(merged["memory_bytes"]),
        bandwidth_bytes_s=merged.get("bandwidth_bytes_s"),
        overhead_s=merged.get("overhead_s"),
        flops=merged.get("flops"),
        block_s=merged.get("block_s"),
        block_dispatch_s=merged.get("block_dispatch_s"),
        head_s=merged.get("head_s"),
        stage_fixed_s=merged.get("stage_fixed_s"),
        nat=_nat(t, where),
        rtt_s=None if rtt is None else rtt * 1e-3,
    )


_MEASURED = ("memory_bytes", "bandwidth_bytes_s", "overhead_s", "flops")
_MODEL_TIMED = ("block_s", "block_dispatch_s", "head_s", "stage_fixed_s")  # valid for one model only


def _probe_file(t: dict[str, Any], where: str, model: str, read_json: ReadJson | None) -> dict[str, Any]:
    """The figures of a `kafila probe --json` file (its "device" object); the block and block
    dispatch times only when the probe timed this session's model."""
    path = t.get("probe")
    if path is None:
        return {}
    if not isinstance(path, str) or not path:
        raise FleetError(f"{where}: 'probe' must be a file path, got {path!r}")
    if read_json is None:
        raise FleetError(f"{where}: 'probe' files can only be read when the fleet is loaded from a file")
    try:
        data = read_json(path)
        device = data.get("device", data)
        out = {k: device[k] for k in _MEASURED if device.get(k) is not None}
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise FleetError(f"{where}: cannot read probe file {path!r}: {exc}") from exc
    probed_model = (data.get("probe") or {}).get("block_model")
    if probed_model == model:  # both timed this model's blocks
        out |= {k: device[k] for k in _MODEL_TIMED if device.get(k) is not None}
    return out


def _nat(t: dict[str, Any], where: str) -> Nat | None:
    cls, filtering = t.get("nat"), t.get("filtering")
    choices = [c.value for c in NatClass]
    if cls is None:
        if filtering is not None:
            raise FleetError(f"{where}: 'filtering' given without 'nat'")
        return None
    if cls not in choices:
        raise FleetError(f"{where}: nat must be one of {choices}, got {cls!r}")
    behaviours = [b.value for b in Behaviour]
    if filtering is not None and filtering not in behaviours:
        raise FleetError(f"{where}: filtering must be one of {behaviours}, got {filtering!r}")
    return Nat(NatClass(cls), filtering=Behaviour(filtering) if filtering else None)


def _no_unknown(t: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(t) - allowed)
    if extra:
        raise FleetError(f"{where}: unknown field(s) {extra}; allowed: {sorted(allowed)}")


def _get(t: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in t:
        raise FleetError(f"{where}: missing '{key}'")
    if not isinstance(t[key], kind) or (kind is str and not t[key]):
        raise FleetError(f"{where}: '{key}' must be a non-empty {kind.__name__}, got {t[key]!r}")
    return t[key]


def _number(
    t: dict[str, Any], key: str, where: str, required: bool = False, allow_zero: bool = False
) -> float | None:
    if key not in t:
        if required:
            raise FleetError(f"{where}: missing '{key}'")
        return None
    v = t[key]
    ok = isinstance(v, int | float) and not isinstance(v, bool) and (v >= 0 if allow_zero else v > 0)
    if not ok:
        raise FleetError(f"{where}: '{key}' must be a number {'>=' if allow_zero else '>'} 0, got {v!r}")
    return float(v)


def _positive_int(t: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    if key not in t and default is not None:
        return default
    v = _get(t, key, int, where)
    if isinstance(v, bool) or v < 1:
        raise FleetError(f"{where}: '{key}' must be an integer >= 1, got {v!r}")
    return int(v)
