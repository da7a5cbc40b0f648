"""The rolling upgrade's reading side (ops.upgrade): whether the session can serve without each
member (the real planner over the fleet file's devices) and what a build's answer must be."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafila.proto.speaks import THIS
from ops.fleetfile import parse
from ops.remote import OpsError
from ops.upgrade import BUILD_INFO, build_from, serves_without

ROOT = Path(__file__).resolve().parents[2]


def test_the_lab_fleet_serves_without_any_one_of_its_members() -> None:
    fleet = parse((ROOT / "fleets" / "lab.toml").read_text(), "lab.toml")
    assert serves_without(fleet, ["h1", "h2", "h3"]) == {"h1": None, "h2": None, "h3": None}


def test_a_member_whose_memory_the_model_needs_cannot_go() -> None:
    text = (ROOT / "fleets" / "lab.toml").read_text()
    small = text.replace("memory_gb = 2", "memory_gb = 0.15")  # the model needs all three
    fleet = parse(small, "small.toml")
    assert serves_without(fleet, ["h2"]) == {
        "h2": "h1: 15 blocks + head need 186.4 MB, has 150.0 MB (context 512 x concurrency 4)"
    }


def test_a_build_is_read_from_the_last_line_and_an_old_kafila_is_named() -> None:
    import json

    assert build_from("a warning\n" + json.dumps(THIS.to_dict()) + "\n", "here") == THIS
    with pytest.raises(OpsError, match=r"here: no wire versions read .*older than kafila\.proto\.speaks"):
        build_from("No module named kafila.proto.speaks\n", "here")


def test_the_build_version_is_read_from_the_metrics_text() -> None:
    text = '# TYPE kafila_build_info gauge\nkafila_build_info{version="0.1.1",backend="numba"} 1.0\n'
    m = BUILD_INFO.search(text)
    assert m is not None and m.group(1) == "0.1.1"
