"""Fleet TOML parsing: values converted to SI units, errors name the device and the field."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("memory_gb = 16", "memory_gb = -1"), "device 'laptop': 'memory_gb' must be a number > 0"),
        (("memory_gb = 16", "memory = 16"), "device 'laptop': unknown field(s) ['memory']"),
        (('nat = "ordinary"', 'nat = "cone"'), "device 'desk': nat must be one of"),
        (
            ("bandwidth_gb_s = 500", 'bandwidth_gb_s = "fast"'),
            "device 'desk': 'bandwidth_gb_s' must be a number",
        ),
        (('name = "laptop"', 'name = "desk"'), "device names must be unique, repeated: ['desk']"),
        (("context = 8192", "context = 0"), "[session]: 'context' must be an integer >= 1"),
        (('model = "qwen3-8b"', ""), "[session]: missing 'model'"),
        (('name = "laptop"\n', ""), "device #2: missing 'name'"),
        (("rtt_ms = 20", "rtt_ms = true"), "device 'desk': 'rtt_ms' must be a number >= 0"),
    ],
)
def test_errors_name_the_device_and_field(edit, message):
    old, new = edit
    assert old in GOOD
    with pytest.raises(FleetError) as err:
        parse_fleet(GOOD.replace(old, new, 1), "f.toml")
    assert message in str(err.value) and str(err.value).startswith("f.toml")


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
        },
    }
    text = (
        '[session]\nmodel = "qwen3-8b"\ncontext = 64\n'
        '[[device]]\nname = "d"\nprobe = "d.json"\nmemory_gb = 4\n'
    )
    (d,) = parse_fleet(text, "f.toml", lambda path: data).devices
    assert d.memory_bytes == 4 * 10**9 and d.bandwidth_bytes_s == 1e10 and d.block_s == 0.01
    assert d.block_dispatch_s == 0.002 and d.stage_fixed_s == 0.0  # a measured zero is kept
    other = text.replace('model = "qwen3-8b"', 'model = "qwen3-14b"')
    (o,) = parse_fleet(other, "f.toml", lambda path: data).devices
    assert o.block_s is None and o.block_dispatch_s is None and o.stage_fixed_s is None
    with pytest.raises(FleetError, match="only be read when the fleet is loaded from a file"):
        parse_fleet(text, "f.toml")

    def missing(path):
        raise OSError(f"no such file: {path}")

    with pytest.raises(FleetError, match=r"device 'd': cannot read probe file 'd\.json'"):
        parse_fleet(text, "f.toml", missing)
