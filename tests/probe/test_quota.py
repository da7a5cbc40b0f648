"""A member under a cgroup v1 CPU quota measures the share it gets (root; real cgroups, real probe)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
pytestmark = [
    pytest.mark.root,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not (CPU_ROOT / "cpu.cfs_quota_us").exists(),
        reason="needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu",
    ),
]

# One process (torch imported once, at full speed) probes itself in one group, then in the other;
# writing its pid to cgroup.procs moves every thread of the process.
CHILD = """
import json, os, sys
from kafila.probe.measure import probe
probe("torch", "fp32", repeats=1, stream_bytes=8 << 20)  # torch and its thread pool warmed up
out = []
for group in sys.argv[1:]:
    open(os.path.join(group, "cgroup.procs"), "w").write(str(os.getpid()))
    r = probe("torch", "fp32", repeats=2, stream_bytes=32 << 20)
    out.append({"flops": r.flops.median, "quota": r.cpu_quota, "threads": r.threads})
print(json.dumps(out), flush=True)
# leave the quota before exiting: torch's teardown at a twentieth of a core takes ~15 s
open(os.path.join(os.path.dirname(sys.argv[1]), "cgroup.procs"), "w").write(str(os.getpid()))
"""


def make_group(quota_us: int) -> Path:
    group = CPU_ROOT / f"kafila-test-probe-{os.getpid()}-{quota_us}"
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text("100000")
    (group / "cpu.cfs_quota_us").write_text(str(quota_us))
    return group


def test_probe_under_a_cpu_quota_measures_the_share_it_gets():
    # both quotas are below what a process gets even on this shared 2-core machine, so both bind
    groups = [make_group(10_000), make_group(5_000)]
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, *map(str, groups)], capture_output=True, text=True, timeout=120
        )
    finally:
        for g in groups:
            g.rmdir()
    assert out.returncode == 0, out.stderr[-2000:]
    tenth, twentieth = json.loads(out.stdout.strip().splitlines()[-1])
    assert tenth["quota"] == pytest.approx(0.1) and twentieth["quota"] == pytest.approx(0.05)
    assert tenth["threads"] == twentieth["threads"] == 1
    assert twentieth["flops"] < 0.75 * tenth["flops"], (twentieth, tenth)
