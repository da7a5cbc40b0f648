"""Fleet TOML parsing: values converted to SI units, errors name the device and the field."""

from __future__ import annotations

import math

import pytest

from kafila.models.presets import resolve_manifest
from kafila.planner import plan_all
from kafila.planner.fleet import FleetError, parse_fleet
from kafila.planner.reachability import Behaviour, NatClass

GOOD = """
[session]
model = "qwen3-8b"
context = 8192
concurrency = 2

[[device]]
name = "desk"
memory_gb = 24
bandwidth_gb_s = 500
overhead_us = 40
tflops = 100
nat = "ordinary"
filtering = "address-dependent"
rtt_ms = 20

[[device]]
name = "laptop"
memory_gb = 16
"""


def test_parses_a_fleet_in_si_units():
    fleet = parse_fleet(GOOD)
    assert (fleet.model, fleet.context, fleet.concurrency) == ("qwen3-8b", 8192, 2)
    desk, laptop = fleet.devices
    assert desk.memory_bytes == 24 * 10**9 and desk.bandwidth_bytes_s == 500e9
    assert desk.overhead_s == pytest.approx(40e-6) and desk.flops == 100e12 and desk.rtt_s == 0.02
    assert desk.nat.cls is NatClass.ORDINARY and desk.nat.filtering is Behaviour.ADDRESS_DEPENDENT
    assert laptop.bandwidth_bytes_s is None and laptop.nat is None
    assert desk.nat.open_input is False


def test_a_router_with_open_input_is_declared_in_the_fleet_file():
    fleet = parse_fleet(GOOD.replace('filtering = "address-dependent"', "open_input = true"))
    assert fleet.devices[0].nat is not None and fleet.devices[0].nat.open_input is True
    with pytest.raises(FleetError, match="device 'desk': open_input must be true or false, got 'yes'"):
        parse_fleet(GOOD.replace('filtering = "address-dependent"', 'open_input = "yes"'))
    with pytest.raises(FleetError, match="device 'laptop': 'open_input' given without 'nat'"):
        parse_fleet(GOOD + "open_input = true\n")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            ("memory_gb = 16", "memory_gb = -1"),
            "device 'laptop': 'memory_gb' must be a finite number > 0 and <= 1e+06, got -1",
        ),
        (("memory_gb = 16", "memory = 16"), "device 'laptop': unknown field(s) ['memory']"),
        (
            ("bandwidth_gb_s = 500", "bandwith_gb_s = 500"),
            "device 'desk': unknown field(s) ['bandwith_gb_s'] "
            "('bandwith_gb_s': did you mean 'bandwidth_gb_s'?)",
        ),
        (('nat = "ordinary"', 'nat = "cone"'), "device 'desk': nat must be one of"),
        (
            ("bandwidth_gb_s = 500", 'bandwidth_gb_s = "fast"'),
            "device 'desk': 'bandwidth_gb_s' must be a finite number",
        ),
        (('name = "laptop"', 'name = "desk"'), "device names must be unique, repeated: ['desk']"),
        (("context = 8192", "context = 0"), "[session]: 'context' must be an integer >= 1"),
        (("context = 8192", 'context = "8192"'), "[session]: 'context' must be an integer >= 1"),
        (("concurrency = 2", "concurrency = 4294967296"), "'concurrency' must be an integer >= 1 and <="),
        (('model = "qwen3-8b"', ""), "[session]: missing 'model'"),
        (('name = "laptop"\n', ""), "device #2: missing 'name'"),
        (("rtt_ms = 20", "rtt_ms = true"), "device 'desk': 'rtt_ms' must be a finite number >= 0"),
        # TOML reads inf and nan; 1e300 GB is inf bytes: each a named refusal, not an OverflowError
        (("memory_gb = 16", "memory_gb = inf"), "device 'laptop': 'memory_gb' must be a finite number > 0"),
        (("memory_gb = 16", "memory_gb = 1e300"), "'memory_gb' must be a finite number > 0 and <= 1e+06"),
        (("memory_gb = 16", "memory_gb = nan"), "device 'laptop': 'memory_gb' must be a finite number"),
        (
            ("bandwidth_gb_s = 500", "bandwidth_gb_s = inf"),
            "device 'desk': 'bandwidth_gb_s' must be a finite",
        ),
        (("rtt_ms = 20", "rtt_ms = inf"), "device 'desk': 'rtt_ms' must be a finite number >= 0"),
        (("overhead_us = 40", "overhead_us = -inf"), "device 'desk': 'overhead_us' must be a finite number"),
        (("tflops = 100", "tflops = 1e300"), "device 'desk': 'tflops' must be a finite number"),
    ],
)
def test_errors_name_the_device_and_field(edit, message):
    old, new = edit
    assert old in GOOD
    with pytest.raises(FleetError) as err:
        parse_fleet(GOOD.replace(old, new, 1), "f.toml")
    assert message in str(err.value) and str(err.value).startswith("f.toml")


def test_unknown_top_level_keys_and_tables_are_refused_by_name():
    """A misspelled table or key at the top level was ignored: `[[devices]]` planned without its device."""
    text = "sesion = 1\n" + GOOD + '[[devices]]\nname = "b"\nmemory_gb = 24\n'
    with pytest.raises(FleetError) as err:
        parse_fleet(text, "f.toml")
    assert str(err.value) == (
        "f.toml: unknown top-level key(s) ['devices', 'sesion'] ('devices': did you mean 'device'?; "
        "'sesion': did you mean 'session'?); allowed: ['device', 'fleet', 'rendezvous', 'session', 'site']"
    )


def test_rejects_a_file_without_devices_or_not_toml():
    with pytest.raises(FleetError, match="at least one"):
        parse_fleet('[session]\nmodel = "x"\ncontext = 1\n')
    with pytest.raises(FleetError, match="not valid TOML"):
        parse_fleet("[session")


def test_probe_file_fills_measurements_and_explicit_fields_win():
    data = {
        "probe": {"block_model": "qwen3-8b"},
        "device": {
            "memory_bytes": 5 * 10**9,
            "bandwidth_bytes_s": 1e10,
            "overhead_s": 2e-4,
            "block_s": 0.01,
            "block_dispatch_s": 0.002,
            "stage_fixed_s": 0.0,
            "wake_s": 3e-4,
            "wake_tau_s": 0.008,
        },
    }
    text = (
        '[session]\nmodel = "qwen3-8b"\ncontext = 64\n'
        '[[device]]\nname = "d"\nprobe = "d.json"\nmemory_gb = 4\n'
    )
    (d,) = parse_fleet(text, "f.toml", lambda path: data).devices
    assert d.memory_bytes == 4 * 10**9 and d.bandwidth_bytes_s == 1e10 and d.block_s == 0.01
    assert d.block_dispatch_s == 0.002 and d.stage_fixed_s == 0.0  # a measured zero is kept
    assert (d.wake_s, d.wake_tau_s) == (3e-4, 0.008)
    other = text.replace('model = "qwen3-8b"', 'model = "qwen3-14b"')
    (o,) = parse_fleet(other, "f.toml", lambda path: data).devices
    assert o.block_s is None and o.block_dispatch_s is None and o.stage_fixed_s is None
    assert o.wake_s is None and o.wake_tau_s is None  # timed with another model's one-block stage
    with pytest.raises(FleetError, match="only be read when the fleet is loaded from a file"):
        parse_fleet(text, "f.toml")

    def missing(path):
        raise OSError(f"no such file: {path}")

    with pytest.raises(FleetError, match=r"device 'd': cannot read probe file 'd\.json'"):
        parse_fleet(text, "f.toml", missing)


PROBED = '[session]\nmodel = "qwen3-8b"\ncontext = 64\n[[device]]\nname = "d"\nprobe = "d.json"\n'


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"device": {"memory_bytes": 8e9}, "probe": "x"}, "'probe' must be an object, got 'x'"),
        ({"device": {"memory_bytes": "lots"}}, "'memory_bytes' must be a finite number >= 0"),
        (
            {"device": {"memory_bytes": -5}},
            "'memory_bytes' must be a finite number >= 0 and <= 1e+15, got -5",
        ),
        ({"device": {"memory_bytes": float("inf")}}, "'memory_bytes' must be a finite number"),
        ({"device": {"memory_bytes": 8e9, "bandwidth_bytes_s": -1}}, "'bandwidth_bytes_s' must be a finite"),
        (
            {"probe": {"block_model": "qwen3-8b"}, "device": {"memory_bytes": 8e9, "block_s": 0.0}},
            "'block_s' must be a finite number >= 1e-09 and <= 1000, got 0.0",
        ),
        ([1, 2], "must hold a JSON object, got list"),
        ({"device": "box"}, "'device' must be an object, got 'box'"),
    ],
)
def test_probe_file_figures_are_checked_and_errors_name_the_file_device_and_field(data, message):
    with pytest.raises(FleetError) as err:
        parse_fleet(PROBED, "f.toml", lambda path: data)
    text = str(err.value)
    assert text.startswith("f.toml: device 'd': probe file 'd.json': ") and message in text


def test_a_device_without_memory_says_its_probe_file_has_none():
    with pytest.raises(FleetError) as err:
        parse_fleet(PROBED, "f.toml", lambda path: {"device": {"bandwidth_bytes_s": 1e10}})
    assert (
        str(err.value)
        == "f.toml: device 'd': missing 'memory_gb' (its probe file 'd.json' has no 'memory_bytes')"
    )


# Each fleet number at the ends of its range, and just past them.
EDGES = [
    ("memory_gb", 1e6, 1.01e6),
    ("bandwidth_gb_s", 1e-6, 0.99e-6),
    ("bandwidth_gb_s", 1e6, 1.01e6),
    ("overhead_us", 1e9, 1.01e9),
    ("tflops", 1e-9, 0.99e-9),
    ("tflops", 1e6, 1.01e6),
    ("rtt_ms", 1e7, 1.01e7),
]
MEASURED = "memory_gb = 24\nbandwidth_gb_s = 500\noverhead_us = 40\ntflops = 100\nrtt_ms = 20\n"


@pytest.mark.parametrize(("key", "edge", "past"), EDGES)
def test_numbers_at_the_ends_of_their_ranges_plan_with_finite_figures(key, edge, past):
    """The ranges keep the planner's arithmetic finite (1e-300 GB/s priced a block at inf s and
    the plan at nan; 1e300 GB overflowed), up to the largest context and concurrency a fleet takes."""
    manifest = resolve_manifest("qwen3-32b", "fp32")
    measured = MEASURED.replace("bandwidth_gb_s = 500\n", "") if key == "tflops" else MEASURED  # priced by it
    edited = "".join(
        f"{key} = {{}}\n" if line.startswith(key) else line + "\n" for line in measured.splitlines()
    )
    for count in (1, 2**32 - 1):
        text = (
            f'[session]\nmodel = "qwen3-32b"\ncontext = {count}\nconcurrency = {count}\n'
            f'[[device]]\nname = "edge"\n{edited.format(repr(edge))}[[device]]\nname = "plain"\n{measured}'
        )
        fleet = parse_fleet(text, "f.toml")
        plans = plan_all(fleet.devices, manifest, context=fleet.context, concurrency=fleet.concurrency)
        assert plans["kafila"].tier == ("throughput" if key == "tflops" else "full")
        for p in plans.values():
            for x in (p.bottleneck_s, p.circuit_s, p.per_token_s, p.utilisation):
                assert x is None or math.isfinite(x), (key, edge, p)
        with pytest.raises(FleetError, match=f"device 'edge': '{key}' must be a finite number"):
            parse_fleet(text.replace(repr(edge), repr(past), 1), "f.toml")
