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
open_input = true         # optional: its router's own stack takes unsolicited input (docs/links.md)
rtt_ms = 12               # optional: round trip to the rendezvous

`kafila-ops` fleet files add where things run: [fleet] (its `session_host` names the device that
opens the session: it is planned as the anchor, as if it came first), [rendezvous] and [[site]].
The planner checks only that they are tables (kafila-ops checks their fields: ops/fleetfile.py).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from difflib import get_close_matches
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


@dataclass(frozen=True)
class _Range:
    """The numbers a field accepts: finite, above (or from) `lo`, at most `hi`."""

    lo: float
    hi: float
    lo_open: bool = False  # > lo rather than >= lo

    def holds(self, v: object) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        return (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi  # exact for any int

    def __str__(self) -> str:
        return f"a finite number {'>' if self.lo_open else '>='} {self.lo:g} and <= {self.hi:g}"


# Plausible figures, generous by orders of magnitude. A figure outside is a typo or inf, and one
# far outside overflows the planner's arithmetic (1e300 GB is inf bytes; 1e-300 GB/s prices a
# block at inf seconds, and inf - inf is nan).
_DEVICE_NUMBERS: dict[str, tuple[str, float, _Range]] = {  # fleet field: (DeviceReport field, scale, range)
    "memory_gb": ("memory_bytes", 1e9, _Range(0, 1e6, lo_open=True)),  # up to 1 PB
    "bandwidth_gb_s": ("bandwidth_bytes_s", 1e9, _Range(1e-6, 1e6)),  # 1 KB/s to 1 PB/s
    "overhead_us": ("overhead_s", 1e-6, _Range(0, 1e9)),  # up to 1000 s
    "tflops": ("flops", 1e12, _Range(1e-9, 1e6)),  # 1 kFLOP/s to 1 EFLOP/s
    "rtt_ms": ("rtt_s", 1e-3, _Range(0, 1e7)),  # up to 10^4 s
}
# A probe file's figures (`kafila probe --json`), in SI units: the fleet fields' ranges (a probe may
# find no memory free), and step timings up to 1000 s (a block or head step of at least 1 ns).
_PROBE_NUMBERS: dict[str, _Range] = {
    "memory_bytes": _Range(0, 1e15),
    "bandwidth_bytes_s": _Range(1e3, 1e15),
    "overhead_s": _Range(0, 1e3),
    "flops": _Range(1e3, 1e18),
    "block_s": _Range(1e-9, 1e3),
    "block_dispatch_s": _Range(0, 1e3),
    "head_s": _Range(1e-9, 1e3),
    "stage_fixed_s": _Range(0, 1e3),
    "wake_s": _Range(0, 1e3),
    "wake_tau_s": _Range(1e-9, 1e3),
}
# Session counts: positions and request ids are 32-bit on the wire (kafila.proto.tensor).
MAX_COUNT = 2**32 - 1
_TOP_KEYS = {"session", "device"}
_OPS_TABLES = {"fleet": dict, "rendezvous": dict, "site": list}  # read by kafila-ops (ops/fleetfile.py)
_SESSION_KEYS = {"model", "context", "concurrency"}
_DEVICE_KEYS = {
    "name", "memory_gb", "bandwidth_gb_s", "overhead_us", "tflops", "nat", "filtering", "open_input",
    "rtt_ms", "probe",
}  # fmt: skip
ReadJson = Callable[[str], Any]


def parse_fleet(text: str, source: str = "fleet", read_json: ReadJson | None = None) -> Fleet:
    """Parse and validate a fleet. `read_json(path)` loads a device's `probe` file (the caller
    does the I/O, relative to the fleet file); without it a `probe` field is an error."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise FleetError(f"{source}: not valid TOML: {exc}") from exc
    except RecursionError:  # tomllib recurses into nested arrays and inline tables
        raise FleetError(f"{source}: not valid TOML: nested too deeply") from None
    no_unknown(data, _TOP_KEYS | set(_OPS_TABLES), source, "top-level key(s)")
    for key, kind in _OPS_TABLES.items():
        if key in data and not isinstance(data[key], kind):
            shape = f"[{key}]" if kind is dict else f"[[{key}]]"
            raise FleetError(f"{source}: '{key}' must be a {shape} table, got {data[key]!r}")
    session = data.get("session")
    if not isinstance(session, dict):
        raise FleetError(f"{source}: needs a [session] table with model, context, concurrency")
    no_unknown(session, _SESSION_KEYS, f"{source}: [session]")
    tables = data.get("device")
    if not isinstance(tables, list) or not tables:
        raise FleetError(f"{source}: needs at least one [[device]] table")
    model = _get(session, "model", str, f"{source}: [session]")
    devices = tuple(_device(t, i, source, model, read_json) for i, t in enumerate(tables))
    names = [d.name for d in devices]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise FleetError(f"{source}: device names must be unique, repeated: {dup}")
    devices = _anchor_first(devices, data.get("fleet", {}), source)
    return Fleet(
        model=model,
        context=_positive_int(session, "context", f"{source}: [session]"),
        concurrency=_positive_int(session, "concurrency", f"{source}: [session]", default=1),
        devices=devices,
    )


def _anchor_first(
    devices: tuple[DeviceReport, ...], fleet: dict[str, Any], source: str
) -> tuple[DeviceReport, ...]:
    """The devices with [fleet] session_host (the one that opens the session) first."""
    host = fleet.get("session_host")
    if host is None:
        return devices
    names = [d.name for d in devices]
    if host not in names:
        raise FleetError(
            f"{source}: [fleet] session_host {host!r} is not a [[device]] name; devices: {names}"
        )
    return tuple(sorted(devices, key=lambda d: d.name != host))


def _device(t: Any, index: int, source: str, model: str, read_json: ReadJson | None) -> DeviceReport:
    where = f"{source}: device #{index + 1}"
    if not isinstance(t, dict):
        raise FleetError(f"{where}: must be a table")
    name = _get(t, "name", str, where)
    where = f"{source}: device {name!r}"
    no_unknown(t, _DEVICE_KEYS, where)
    measured = _probe_file(t, where, model, read_json)
    if "memory_gb" not in t and "memory_bytes" not in measured:
        hint = f" (its probe file {t['probe']!r} has no 'memory_bytes')" if "probe" in t else ""
        raise FleetError(f"{where}: missing 'memory_gb'{hint}")
    given: dict[str, float] = {}
    for key, (report_key, scale, allowed) in _DEVICE_NUMBERS.items():
        if key in t:
            if not allowed.holds(t[key]):
                raise FleetError(f"{where}: '{key}' must be {allowed}, got {t[key]!r}")
            given[report_key] = t[key] * scale
    rtt = given.pop("rtt_s", None)
    merged = measured | given
    if "bandwidth_bytes_s" in given:  # an explicit bandwidth asks for bandwidth pricing, not the probed block
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
        wake_s=merged.get("wake_s"),
        wake_tau_s=merged.get("wake_tau_s"),
        nat=_nat(t, where),
        rtt_s=rtt,
    )


_MEASURED = ("memory_bytes", "bandwidth_bytes_s", "overhead_s", "flops")
# valid for one model only
_MODEL_TIMED = ("block_s", "block_dispatch_s", "head_s", "stage_fixed_s", "wake_s", "wake_tau_s")


def _probe_file(t: dict[str, Any], where: str, model: str, read_json: ReadJson | None) -> dict[str, Any]:
    """The figures of a `kafila probe --json` file (its "device" object, or a bare DeviceReport),
    each checked as the fleet's own fields are; the block and block dispatch times only when the
    probe timed this session's model."""
    path = t.get("probe")
    if path is None:
        return {}
    if not isinstance(path, str) or not path:
        raise FleetError(f"{where}: 'probe' must be a file path, got {path!r}")
    if read_json is None:
        raise FleetError(f"{where}: 'probe' files can only be read when the fleet is loaded from a file")
    try:
        data = read_json(path)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc  # the path is named
        raise FleetError(f"{where}: cannot read probe file {path!r}: {why}") from exc
    except RecursionError:  # json recurses into nested arrays and objects
        raise FleetError(f"{where}: cannot read probe file {path!r}: nested too deeply") from None
    where = f"{where}: probe file {path!r}"
    if not isinstance(data, dict):
        raise FleetError(f"{where}: must hold a JSON object, got {type(data).__name__}")
    device, report = data.get("device", data), data.get("probe")
    if not isinstance(device, dict):
        raise FleetError(f"{where}: 'device' must be an object, got {device!r}")
    if report is not None and not isinstance(report, dict):
        raise FleetError(f"{where}: 'probe' must be an object, got {report!r}")
    timed_here = report is not None and report.get("block_model") == model  # both timed this model's blocks
    out: dict[str, Any] = {}
    for key in _MEASURED + (_MODEL_TIMED if timed_here else ()):
        value = device.get(key)
        if value is not None:
            if not _PROBE_NUMBERS[key].holds(value):
                raise FleetError(f"{where}: '{key}' must be {_PROBE_NUMBERS[key]}, got {value!r}")
            out[key] = value
    return out


def _nat(t: dict[str, Any], where: str) -> Nat | None:
    cls, filtering, open_input = t.get("nat"), t.get("filtering"), t.get("open_input", False)
    choices = [c.value for c in NatClass]
    if cls is None:
        for key in ("filtering", "open_input"):
            if key in t:
                raise FleetError(f"{where}: '{key}' given without 'nat'")
        return None
    if not isinstance(open_input, bool):
        raise FleetError(f"{where}: open_input must be true or false, got {open_input!r}")
    if cls not in choices:
        raise FleetError(f"{where}: nat must be one of {choices}, got {cls!r}")
    behaviours = [b.value for b in Behaviour]
    if filtering is not None and filtering not in behaviours:
        raise FleetError(f"{where}: filtering must be one of {behaviours}, got {filtering!r}")
    return Nat(NatClass(cls), filtering=Behaviour(filtering) if filtering else None, open_input=open_input)


def no_unknown(
    t: dict[str, Any], allowed: set[str], where: str, what: str = "field(s)", cutoff: float = 0.75
) -> None:
    """FleetError naming keys of `t` outside `allowed`, with the nearest allowed key as a hint."""
    extra = sorted(set(t) - allowed)
    if extra:
        near = [
            f"{k!r}: did you mean {m[0]!r}?" for k in extra if (m := get_close_matches(k, allowed, 1, cutoff))
        ]
        hint = f" ({'; '.join(near)})" if near else ""
        raise FleetError(f"{where}: unknown {what} {extra}{hint}; allowed: {sorted(allowed)}")


def _get(t: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in t:
        raise FleetError(f"{where}: missing '{key}'")
    if not isinstance(t[key], kind) or (kind is str and not t[key]):
        raise FleetError(f"{where}: '{key}' must be a non-empty {kind.__name__}, got {t[key]!r}")
    return t[key]


def _positive_int(t: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    if key not in t and default is not None:
        return default
    if key not in t:
        raise FleetError(f"{where}: missing '{key}'")
    v = t[key]
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_COUNT:
        raise FleetError(f"{where}: '{key}' must be an integer >= 1 and <= {MAX_COUNT}, got {v!r}")
    return v
