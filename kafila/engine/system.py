"""What the operating system grants this process: memory, CPU share (cgroups), cache size.

Read from /proc and /sys on Linux and `sysctl` on macOS; psutil is not used. Every function
returns None when the figure is not available rather than guessing.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def meminfo_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_paths() -> dict[str, str]:
    """controller -> path from /proc/self/cgroup ("" key for the v2 unified hierarchy)."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    except (OSError, ValueError):
        pass
    return out


def _read_int(file: Path) -> int | None:
    try:
        text = file.read_text().split()[0]
    except (OSError, IndexError):
        return None
    return None if text == "max" else int(text)


def cgroup_memory_room() -> int | None:
    """Bytes left under this process's cgroup memory limits (v1 or v2), or None if unlimited."""
    bound = cgroup_memory_bound()
    return bound[0] if bound else None


def cgroup_memory_bound() -> tuple[int, str] | None:
    """(bytes left, which limit) under the tightest memory limit of this process's cgroup and its
    ancestors (a parent's limit binds its children too), v1 or v2; None if no limit is set."""
    paths = _cgroup_paths()
    if "memory" in paths:
        root, rel, files = (
            CGROUP_ROOT / "memory",
            paths["memory"],
            ("memory.limit_in_bytes", "memory.usage_in_bytes"),
        )
        version = "v1"
    elif "" in paths:
        root, rel, files, version = CGROUP_ROOT, paths[""], ("memory.max", "memory.current"), "v2"
    else:
        return None
    best: tuple[int, str] | None = None
    for d in _ancestors(root, rel):
        limit, usage = _read_int(d / files[0]), _read_int(d / files[1])
        if limit is None or usage is None or limit >= 1 << 60:
            continue
        room = max(0, limit - usage)
        if best is None or room < best[0]:
            best = (room, f"cgroup {version} {d / files[0]}: limit {_gb(limit)}, {_gb(usage)} in use")
    return best


def _ancestors(root: Path, rel: str) -> list[Path]:
    """The cgroup folder of `rel` and each of its parents up to `root`, innermost first."""
    parts = [p for p in rel.split("/") if p]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def cfs_limit() -> tuple[float, float] | None:
    """(quota, period) in seconds of this process's cgroup CFS bandwidth limit (v1 or v2), or None."""
    us = _cfs_us()
    return (us[0] / 1e6, us[1] / 1e6) if us else None


def _cfs_us() -> tuple[int, int] | None:
    paths = _cgroup_paths()
    for key, sub in (("cpu", "cpu"), ("cpu,cpuacct", "cpu,cpuacct")):
        if key in paths:
            d = CGROUP_ROOT / sub / paths[key].lstrip("/")
            quota, period = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
            if quota is not None and quota > 0 and period:
                return quota, period
            return None
    if "" in paths:
        try:
            quota_s, period_s = (CGROUP_ROOT / paths[""].lstrip("/") / "cpu.max").read_text().split()
        except (OSError, ValueError):
            return None
        return None if quota_s == "max" else (int(quota_s), int(period_s))
    return None


def cpu_quota() -> float | None:
    """CPUs this process may use under a cgroup CFS quota (0.25 = a quarter core), or None."""
    us = _cfs_us()
    return us[0] / us[1] if us else None


def cpu_model() -> str:
    """The CPU's model as the kernel names it ("AMD EPYC 9454P 48-Core Processor"), or the
    platform's machine kind where /proc/cpuinfo does not say (macOS, some ARM boards)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


THREADS_ENV = "KAFILA_THREADS"  # set by the CLI's --threads: at most this many compute threads


def usable_cpus() -> int:
    """Threads worth running: the CPUs in our affinity mask, capped by a CFS quota (rounded up)
    and by --threads (the KAFILA_THREADS environment variable the CLI sets from it)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    if quota:
        cpus = max(1, min(cpus, math.ceil(quota)))
    cap = os.environ.get(THREADS_ENV, "")
    return max(1, min(cpus, int(cap))) if cap.isdigit() and int(cap) > 0 else cpus


def llc_bytes() -> int | None:
    """Size of the largest CPU cache level (the last-level cache)."""
    best = None
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1], 1)
        size = int(text.rstrip("KMG")) * mult
        best = size if best is None else max(best, size)
    if best is None and platform.system() == "Darwin":
        best = _sysctl_int("hw.l2cachesize")
    return best


def _sysctl_int(key: str) -> int | None:
    try:
        return int(subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, check=True).stdout)
    except (OSError, ValueError, subprocess.CalledProcessError):
        return None


def system_memory_available() -> int | None:
    """RAM this process could still take: MemAvailable capped by the cgroup limit (macOS: hw.memsize)."""
    budget = memory_budget()
    return budget.available if budget else None


@dataclass(frozen=True)
class MemoryBudget:
    """What this process may allocate, and which figure of the system bounds it."""

    available: int  # bytes it could still take
    source: str  # the bound: a cgroup limit, /proc/meminfo's MemAvailable, or macOS's hw.memsize

    @property
    def kept(self) -> int:
        """What the OS and the API keep of it (`reserve`)."""
        return reserve(self.available)

    @property
    def usable(self) -> int:
        """What weights and the KV cache may take: available less what is kept (as the probe reports)."""
        return max(0, self.available - self.kept)


def memory_budget() -> MemoryBudget | None:
    """The tightest of MemAvailable (macOS: hw.memsize) and the cgroup limits, naming it; None when
    none can be read."""
    avail = meminfo_available()
    source = "MemAvailable in /proc/meminfo"
    if avail is None and platform.system() == "Darwin":
        avail, source = _sysctl_int("hw.memsize"), "hw.memsize (physical memory)"
    bound = cgroup_memory_bound()
    if bound is not None and (avail is None or bound[0] < avail):
        return MemoryBudget(bound[0], bound[1])
    return MemoryBudget(avail, source) if avail is not None else None


def reserve(total: int) -> int:
    """What the OS and the API keep: 10% of the memory, at least 1 GiB (a quarter on tiny hosts)."""
    return min(max(total // 10, 1 << 30), total // 4)
