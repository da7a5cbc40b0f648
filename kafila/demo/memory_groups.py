"""Memory caps for processes on one machine: cgroup v1 `memory` groups made under this process's
own group, each limited to a number of bytes, and their peak usage read back.

A member started inside such a group sees the limit as its memory budget (kafila.engine.system's
`memory_budget` reads the tightest limit on the way to the root), so a local fleet whose members
are capped behaves like machines of that size: the planner divides by the caps, a process that
would exceed its cap is refused before it allocates, and the kernel kills one that allocates
past it anyway. `memory.max_usage_in_bytes` is the group's peak, page cache charged to it
included (the weights it reads from disk), which the kernel reclaims under the limit.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

MEMORY_V1 = Path("/sys/fs/cgroup/memory")
PREFIX = "kafila-mem-"


def own_memory_group() -> Path | None:
    """This process's cgroup v1 memory folder where a child group can be made (root), else None."""
    if os.geteuid() != 0 or not MEMORY_V1.is_dir():
        return None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    rel = next((ln.split(":", 2)[2] for ln in lines if ":memory:" in ln), None)
    folder = MEMORY_V1 / rel.lstrip("/") if rel is not None else None
    return folder if folder is not None and os.access(folder, os.W_OK) else None


def unavailable() -> str | None:
    """Why memory groups cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "not root: cgroup v1 memory groups need root"
    if not MEMORY_V1.is_dir():
        return f"no cgroup v1 memory controller at {MEMORY_V1}"
    if own_memory_group() is None:
        return "this process's memory cgroup is not writable"
    return None


def make_group(limit_bytes: int, label: str = "") -> Path:
    """A new memory group under our own, limited to `limit_bytes` (swap included where the kernel
    accounts it, so a capped process cannot spill past its cap)."""
    parent = own_memory_group()
    if parent is None:
        raise OSError(f"cannot make a memory group: {unavailable()}")
    group = parent / f"{PREFIX}{os.getpid()}-{label or 'g'}-{uuid.uuid4().hex[:6]}"
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    memsw = group / "memory.memsw.limit_in_bytes"
    if memsw.exists():
        with contextlib.suppress(OSError):  # swap accounting off: the plain limit binds alone
            memsw.write_text(str(limit_bytes))
    return group


def inside(group: Path, argv: list[str]) -> list[str]:
    """`argv` run inside `group`: a shell moves itself in, then becomes the command."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *argv]


def peak_bytes(group: Path) -> int:
    """The group's peak memory use since it was made (bytes)."""
    return int((group / "memory.max_usage_in_bytes").read_text())


def oom_kills(group: Path) -> int:
    """How many times the kernel's OOM killer acted in the group (0 where the kernel does not say)."""
    for line in (group / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def remove_group(group: Path, wait_s: float = 5.0) -> None:
    """Remove `group` once its processes have exited (any left over are moved to the parent)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (group.parent / "cgroup.procs").write_text(pid)
            time.sleep(0.1)
