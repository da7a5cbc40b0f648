"""The emulated slower device: CPU time is stretched, waiting is not."""

from __future__ import annotations

import threading
import time

import pytest

from kafila.engine.pace import FULL_SPEED, Pace


def _busy(seconds: float) -> None:
    """Burn `seconds` of this thread's CPU (not the process's: other threads may be running)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Watch:
    """This thread's CPU time and the wall time since it was made: what a paced computation took
    in fact, so the checks hold on a loaded machine (where 50 ms of CPU may take 300 ms of wall)."""

    def __init__(self) -> None:
        self.cpu, self.wall = time.thread_time(), time.perf_counter()

    def took(self) -> tuple[float, float]:
        return time.thread_time() - self.cpu, time.perf_counter() - self.wall


SLACK = 0.03  # a sleep's overshoot


def test_a_quarter_speed_computation_takes_four_times_its_cpu_time() -> None:
    pace = Pace(0.25)
    began = pace.mark()
    watch = Watch()
    _busy(0.05)
    cpu, wall = watch.took()
    took = pace.finish(began)
    assert took >= 4 * cpu  # stretched to four times its CPU time (4 x 50 ms)...
    assert took < max(4 * cpu, wall) + SLACK  # ...and no more than that, or than it already took


def test_waiting_inside_a_computation_is_not_stretched() -> None:
    pace = Pace(0.25)  # a sleep uses no CPU: a machine 4x slower would not wait 4x longer
    began = pace.mark()
    watch = Watch()
    time.sleep(0.05)
    cpu, wall = watch.took()
    took = pace.finish(began)
    assert 0.05 <= took < max(4 * cpu, wall) + SLACK
    assert took < 0.2 or wall >= 0.2 - SLACK  # not 4 x 50 ms, unless the sleep itself took that


def test_another_threads_cpu_time_is_not_stretched() -> None:
    # The member's network thread works while its model thread computes: only the computing
    # thread's CPU time is the emulated device's. Here the computing thread waits while another
    # thread burns 50 ms of CPU: counted as the process's, that would stretch to 200 ms.
    pace = Pace(0.25)
    other = threading.Thread(target=_busy, args=(0.05,))
    began = pace.mark()
    watch = Watch()
    other.start()
    other.join()
    time.sleep(0.01)
    cpu, wall = watch.took()
    took = pace.finish(began)
    assert 0.05 <= took < max(4 * cpu, wall) + SLACK


def test_full_speed_adds_nothing() -> None:
    began = FULL_SPEED.mark()
    watch = Watch()
    _busy(0.02)
    _, wall = watch.took()
    assert FULL_SPEED.finish(began) < wall + 0.005 and not FULL_SPEED.emulated


@pytest.mark.parametrize("speed", [0.0, -0.5, 1.5])
def test_speeds_outside_zero_to_one_are_refused(speed: float) -> None:
    with pytest.raises(ValueError, match=f"must be in \\(0, 1\\], got {speed}"):
        Pace(speed)


def test_emulation_needs_one_cpu_and_says_how() -> None:
    Pace(0.5).check_cpus(1)
    FULL_SPEED.check_cpus(8)
    with pytest.raises(ValueError, match=r"one CPU \(it may use 2\): add --threads 1.*taskset -c 1"):
        Pace(0.5).check_cpus(2)
