"""Wire versions a build speaks (kafila.proto.speaks): who may join whose session, and the refusal
a member of another session-message version reads in its own envelope."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kafila import __version__
from kafila.proto import ring, session, signaling, tensor, udp
from kafila.proto.speaks import (
    SPEAKS,
    THIS,
    Build,
    BuildError,
    cannot_join,
    host_speaks_other,
    other_session_version,
    refusal_in,
    session_version_of,
)

ROOT = Path(__file__).resolve().parents[2]


def build(version: str, **changed: tuple[int, int]) -> Build:
    return Build(version, {**SPEAKS, **changed})


def test_this_build_speaks_the_version_each_wire_module_declares() -> None:
    assert THIS.kafila == __version__
    assert THIS.running() == {
        "signaling": signaling.VERSION,
        "session": session.SESSION_VERSION,
        "terms": session.TERMS_VERSION,
        "ring": ring.RING_VERSION,
        "tensor": tensor.VERSION,
        "udp": udp.VERSION,
    }


def test_adjacent_releases_that_bumped_no_wire_version_share_a_session() -> None:
    assert cannot_join(build("0.1.0"), build("0.1.1")) == []
    assert cannot_join(build("0.1.1"), build("0.1.0")) == []


def test_a_build_that_keeps_the_older_version_too_joins_a_session_of_the_older_one() -> None:
    v = session.SESSION_VERSION
    newer = build("0.2.0", session=(v, v + 1))
    assert cannot_join(build("0.1.0"), newer) == []  # the old host runs v, the new build speaks it
    # but a session the newer build hosts runs v+1, which the old build does not speak
    assert cannot_join(newer, build("0.1.0")) == [
        f"session messages: the session (kafila 0.2.0) runs v{v + 1}, kafila 0.1.0 speaks v{v}"
    ]


def test_an_incompatible_build_is_refused_naming_every_protocol_and_both_versions() -> None:
    t, r = tensor.VERSION, ring.RING_VERSION
    new = build("0.3.0", tensor=(t + 1, t + 1), ring=(r + 1, r + 2))
    assert cannot_join(build("0.1.0"), new) == [
        f"ring-control messages: the session (kafila 0.1.0) runs v{r}, kafila 0.3.0 speaks v{r + 1}-v{r + 2}",
        f"tensor records: the session (kafila 0.1.0) runs v{t}, kafila 0.3.0 speaks v{t + 1}",
    ]
    lacking = Build("0.0.9", {k: v for k, v in SPEAKS.items() if k != "udp"})
    assert cannot_join(THIS, lacking) == [
        f"UDP datagrams: the session (kafila {__version__}) runs v{udp.VERSION}, kafila 0.0.9 speaks none"
    ]


def test_a_build_round_trips_as_json_and_a_bad_one_names_its_field() -> None:
    assert Build.from_dict(json.loads(json.dumps(THIS.to_dict()))) == Build(THIS.kafila, dict(SPEAKS))
    with pytest.raises(BuildError, match="object of kafila and speaks"):
        Build.from_dict({"kafila": "1"})
    with pytest.raises(BuildError, match="kafila must be a version text"):
        Build.from_dict({"kafila": 1, "speaks": {}})
    with pytest.raises(BuildError, match=r"speaks\['ring'\] must be \[oldest, newest\]"):
        Build.from_dict({"kafila": "1", "speaks": {"ring": [3, 2]}})
    with pytest.raises(BuildError, match=r"speaks\['ring'\]"):
        Build.from_dict({"kafila": "1", "speaks": {"ring": [True, 2]}})


def test_the_refusal_is_in_the_joiners_envelope_and_parses_there_as_refused() -> None:
    v = session.SESSION_VERSION
    why = other_session_version(v - 1)
    assert why == (
        f"this member speaks session messages v{v - 1}; the session's host (kafila {__version__}) speaks "
        f"v{v}: join with a newer kafila that speaks v{v}"
    )
    assert "an older kafila" in other_session_version(v + 1)
    body = refusal_in(v - 1, why)
    assert body == {session.KEY: v - 1, "op": "refused", "reason": why}
    # `refused` has one shape in every version: this version's parser reads it in its own envelope
    assert session.Refused.parse({**body, session.KEY: v}).reason == why
    assert session_version_of(body) == v - 1
    assert session_version_of({"other": 1}) is None and session_version_of({session.KEY: True}) is None
    assert host_speaks_other(v + 1).startswith(f"the session's host speaks session messages v{v + 1}; ")


def test_python_m_prints_this_builds_versions() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kafila.proto.speaks"], capture_output=True, text=True, timeout=60,
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert Build.from_dict(json.loads(done.stdout)) == Build(THIS.kafila, dict(SPEAKS))
