"""cgroup and /proc readers against fake trees (the real ones are read by the probe tests)."""

from __future__ import annotations

import pytest

from kafila.engine import system
from kafila.probe.stats import Figure


def fake_cgroup(monkeypatch, tmp_path, paths, files):
    monkeypatch.setattr(system, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(system, "_cgroup_paths", lambda: paths)
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def test_cgroup_v1_cpu_quota(monkeypatch, tmp_path):
    fake_cgroup(
        monkeypatch,
        tmp_path,
        {"cpu": "/member-1"},
        {"cpu/member-1/cpu.cfs_quota_us": "25000\n", "cpu/member-1/cpu.cfs_period_us": "100000\n"},
    )
    assert system.cpu_quota() == 0.25
    assert system.cfs_limit() == (0.025, 0.1)
    assert system.usable_cpus() == 1


def test_cgroup_v1_unlimited_and_v2(monkeypatch, tmp_path):
    fake_cgroup(
        monkeypatch,
        tmp_path,
        {"cpu": "/"},
        {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"},
    )
    assert system.cpu_quota() is None
    fake_cgroup(monkeypatch, tmp_path, {"": "/box"}, {"box/cpu.max": "150000 100000\n"})
    assert system.cpu_quota() == 1.5
    assert system.cfs_limit() == pytest.approx((0.15, 0.1))


def test_cgroup_memory_room(monkeypatch, tmp_path):
    fake_cgroup(
        monkeypatch,
        tmp_path,
        {"memory": "/m"},
        {"memory/m/memory.limit_in_bytes": "4000000000\n", "memory/m/memory.usage_in_bytes": "1000000000\n"},
    )
    assert system.cgroup_memory_room() == 3_000_000_000
    fake_cgroup(monkeypatch, tmp_path, {"": "/u"}, {"u/memory.max": "max\n", "u/memory.current": "5\n"})
    assert system.cgroup_memory_room() is None


def test_real_machine_readers_return_plausible_values():
    avail = system.system_memory_available()
    assert avail is None or avail > 1 << 28
    llc = system.llc_bytes()
    assert llc is None or llc >= 1 << 16
    assert system.usable_cpus() >= 1
    assert system.reserve(16 << 30) == (16 << 30) // 10 and system.reserve(2 << 30) == (2 << 30) // 4


def test_figure_median_and_spread():
    f = Figure.of([1.0, 3.0, 2.0, 2.0], "s")
    assert (f.median, f.lo, f.hi, f.n) == (2.0, 1.0, 3.0, 4)
    assert f.spread == 0.5
    assert Figure.from_dict(f.to_dict()) == f


def test_quota_window_spans_whole_cfs_periods():
    from kafila.probe.measure import QUOTA_WINDOW_S, WINDOW_S, quota_window

    assert quota_window(None) == WINDOW_S
    assert QUOTA_WINDOW_S == 0.25
    assert quota_window((0.025, 0.1)) == pytest.approx(0.3)  # 2.5 periods would be phase-dependent
    assert quota_window((0.05, 0.05)) == pytest.approx(0.25)
    assert quota_window((0.5, 1.0)) == pytest.approx(1.0)


def test_threads_flag_caps_the_usable_cpus(monkeypatch):
    monkeypatch.setattr(system.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})  # simulated 4 CPUs
    monkeypatch.setattr(system, "cpu_quota", lambda: None)
    monkeypatch.delenv(system.THREADS_ENV, raising=False)
    assert system.usable_cpus() == 4
    monkeypatch.setenv(system.THREADS_ENV, "2")
    assert system.usable_cpus() == 2
    monkeypatch.setenv(system.THREADS_ENV, "9")  # never more than the CPUs
    assert system.usable_cpus() == 4


def test_cli_threads_flag_reaches_the_probe_in_a_fresh_process():
    import json
    import subprocess
    import sys

    argv = [sys.executable, "-m", "kafila", "probe", "--threads", "1", "--repeats", "1", "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True).stdout
    assert json.loads(out)["probe"]["threads"] == 1
