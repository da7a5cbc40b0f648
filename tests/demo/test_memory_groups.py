"""A memory group caps the process started inside it: the process's memory budget reads the cap,
its peak is read back, and allocating past the cap gets it killed by the kernel (real cgroup v1
groups; root)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kafila.demo import memory_groups

MB = 1_000_000

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        memory_groups.unavailable() is not None, reason=f"memory groups: {memory_groups.unavailable()}"
    ),
]

CHILD = """
import sys
from kafila.engine.system import memory_budget
b = memory_budget()
print(b.available, b.source)
held = bytearray(int(sys.argv[1]) * 1_000_000)  # zero-filled: every page touched
print(len(held))
"""


def _run_inside(limit: int, allocate_mb: int) -> tuple[subprocess.CompletedProcess[str], int, int]:
    group = memory_groups.make_group(limit, "test")
    try:
        argv = memory_groups.inside(group, [sys.executable, "-c", CHILD, str(allocate_mb)])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return done, memory_groups.peak_bytes(group), memory_groups.oom_kills(group)
    finally:
        memory_groups.remove_group(group)
        assert not group.exists()


def test_a_process_in_a_group_sees_the_cap_as_its_budget_and_its_peak_is_read_back() -> None:
    done, peak, kills = _run_inside(300 * MB, 120)
    assert done.returncode == 0, done.stderr
    available, source = done.stdout.splitlines()[0].split(" ", 1)
    assert int(available) <= 300 * MB
    assert "kafila-mem-" in source and "limit 0.30 GB" in source, source
    assert 120 * MB < peak <= 300 * MB
    assert kills == 0


def test_a_process_that_allocates_past_its_cap_is_killed_by_the_kernel() -> None:
    done, peak, kills = _run_inside(150 * MB, 400)
    assert done.returncode == -9, (done.returncode, done.stderr[-500:])
    assert kills >= 1
    assert peak <= 150 * MB
