"""The emulated slower device: CPU time is stretched, waiting is not."""

from __future__ import annotations

import threading
import time

import pytest

from kafila.engine.pace import FULL_SPEED, Pace


def _busy(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_quarter_speed_computation_takes_four_times_its_cpu_time() -> None:
    pace = Pace(0.25)
    began = pace.mark()
    _busy(0.05)
    took = pace.finish(began)
    assert 0.19 < took < 0.30  # 4 x 50 ms of CPU (plus scheduling slack)


def test_waiting_inside_a_computation_is_not_stretched() -> None:
    pace = Pace(0.25)  # a sleep uses no CPU: a machine 4x slower would not wait 4x longer
    began = pace.mark()
    time.sleep(0.05)
    assert 0.05 <= pace.finish(began) < 0.08


def test_another_threads_cpu_time_is_not_stretched() -> None:
    # The member's network thread works while its model thread computes: only the computing
    # thread's CPU time is the emulated device's. Here the computing thread waits 60 ms while
    # another thread burns 50 ms of CPU: counted as the process's, that would be 200 ms.
    pace = Pace(0.25)
    other = threading.Thread(target=_busy, args=(0.05,))
    began = pace.mark()
    other.start()
    other.join()
    time.sleep(0.01)
    assert 0.05 <= pace.finish(began) < 0.12


def test_full_speed_adds_nothing() -> None:
    began = FULL_SPEED.mark()
    _busy(0.02)
    assert FULL_SPEED.finish(began) < 0.04 and not FULL_SPEED.emulated


@pytest.mark.parametrize("speed", [0.0, -0.5, 1.5])
def test_speeds_outside_zero_to_one_are_refused(speed: float) -> None:
    with pytest.raises(ValueError, match=f"must be in \\(0, 1\\], got {speed}"):
        Pace(speed)


def test_emulation_needs_one_cpu_and_says_how() -> None:
    Pace(0.5).check_cpus(1)
    FULL_SPEED.check_cpus(8)
    with pytest.raises(ValueError, match=r"one CPU \(it may use 2\): add --threads 1.*taskset -c 1"):
        Pace(0.5).check_cpus(2)
