"""`Pace`: an emulated slower device, for fleets of several members on one machine.

A member started with `--emulate-speed S` (0 < S <= 1) runs on one CPU of its own and stretches
every timed computation of its model (probe figures and stage steps alike): it idles until the
computation has taken its CPU time / S. With S = 0.25 a step that used 5 ms of CPU occupies the
model thread for 20 ms, 15 of them asleep. This emulates a device S times as fast that has a CPU
to itself:
- CPU time, not wall time, is what gets stretched, so time the member spends waiting for a CPU
  that another member on the same core holds is not multiplied by 1/S (wall time would be);
- the sleep leaves the core to the others, as a separate, slower machine would;
- the slowdown is the same in the probe and in the ring, which a CFS quota's is not (a quota'd
  process coming out of idle bursts ahead of its share; see docs/benchmarks.md).
The CPU time is the computing thread's own: the member's network thread, which keeps receiving
and sending other requests' frames while a stage step runs, is not slowed (a slower device's
compute is slower, not its network stack; process CPU time stretched that work by 1/S as well,
by as much as 10 ms a step with four users at S = 0.25). So the computation must run on the
thread that times it: the member computes with one thread (--threads 1, or pinned to one CPU,
where numba and torch run on the calling thread). `Pace.check_cpus` says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Mark:
    """When a computation began: wall clock and the calling thread's CPU time, in seconds."""

    wall: float
    cpu: float


@dataclass(frozen=True)
class Pace:
    speed: float = 1.0  # fraction of this machine's one-CPU speed the member emulates

    def __post_init__(self) -> None:
        if not 0.0 < self.speed <= 1.0:
            raise ValueError(f"emulated speed must be in (0, 1], got {self.speed}")

    @property
    def emulated(self) -> bool:
        return self.speed < 1.0

    def check_cpus(self, usable_cpus: int) -> None:
        """Refuse an emulation whose CPU time would count several CPUs at once."""
        if self.emulated and usable_cpus != 1:
            raise ValueError(
                f"--emulate-speed {self.speed:g} needs this member to compute on one CPU (it may use "
                f"{usable_cpus}): add --threads 1, or pin it with e.g. `taskset -c 1 kafila join ...`"
            )

    @staticmethod
    def mark() -> Mark:
        return Mark(time.perf_counter(), time.thread_time())

    def finish(self, began: Mark) -> float:
        """Call on the thread that ran the computation that began at `began`: idle until it has
        taken its CPU time / speed; returns the seconds since `began`, idle included."""
        if self.emulated:
            cpu = time.thread_time() - began.cpu
            idle = cpu / self.speed - (time.perf_counter() - began.wall)
            if idle > 0:
                time.sleep(idle)
        return time.perf_counter() - began.wall


FULL_SPEED = Pace()  # no emulation: the default everywhere
