"""How `kafila demo`'s harness starts its children: whatever folder it runs in and whatever log
level is asked for, a child is the installed kafila and its readiness comes from the child itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kafila.demo.fleet import _PYTHON, LocalFleet


def shadowing_folder(where: Path) -> Path:
    """A folder holding a `kafila` package that is not kafila, as the clone's parent folder does
    (its `kafila/` is the repository, whose top has no __version__)."""
    fake = where / "kafila"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('the shadowing kafila was imported')\n")
    return where


def test_children_import_kafila_past_a_shadowing_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(shadowing_folder(tmp_path))
    plain = subprocess.run([sys.executable, "-m", "kafila", "--version"], capture_output=True, text=True)
    assert plain.returncode != 0 and "shadowing" in plain.stderr  # what children used to run
    child = subprocess.run([*_PYTHON, "-m", "kafila", "--version"], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr


def test_rendezvous_is_ready_at_warning_level_from_a_shadowing_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KAFILA_LOG_LEVEL=warning silences the rendezvous's "rendezvous_started" line, which the
    harness used to wait for; it now asks the child's health check."""
    monkeypatch.chdir(shadowing_folder(tmp_path))
    monkeypatch.setenv("KAFILA_LOG_LEVEL", "warning")
    fleet = LocalFleet([None], workdir=tmp_path / "fleet")
    fleet.workdir = tmp_path / "fleet"
    fleet.workdir.mkdir()
    try:
        fleet._start_rendezvous()
        assert fleet.rendezvous_url is not None
        http = fleet.rendezvous_url.replace("ws://", "http://").split("/", 3)
        assert httpx.get(f"{http[0]}//{http[2]}/healthz", timeout=5.0).status_code == 200
        assert "rendezvous_started" not in (tmp_path / "fleet" / "rendezvous.log").read_text()
    finally:
        fleet.close()
