"""Debian's `promtool` (package `prometheus`, installed by .ci/run) run on real files and output."""

from __future__ import annotations

import shutil
import subprocess

import pytest

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (apt-get install --no-install-recommends prometheus)"
)


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    """`promtool ARGS`, its output as text (stdout and stderr together)."""
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, timeout=120, check=False)
    out = (done.stdout + done.stderr).decode(errors="replace")
    return subprocess.CompletedProcess(done.args, done.returncode, out, "")


def check_metrics(exposition: bytes) -> str:
    """promtool's lint of a /metrics text: "" when clean, its complaints otherwise."""
    done = promtool("check", "metrics", stdin=exposition)
    return "" if done.returncode == 0 and not done.stdout.strip() else done.stdout
