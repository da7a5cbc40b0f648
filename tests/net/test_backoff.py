"""The reconnection schedule (pure): capped exponential back-off with jitter."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kafila.net.backoff import Backoff


def test_the_default_schedule_doubles_from_half_a_second_to_thirty() -> None:
    b = Backoff()
    assert [b.ceiling(n) for n in range(1, 10)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert b.delay(1, 0.0) == 0.5 and b.delay(1, 0.999) == pytest.approx(0.25, abs=1e-3)
    assert b.delay(10**9, 0.5) == 22.5  # no overflow however long it has been trying


@given(
    attempt=st.integers(1, 10_000),
    draw=st.floats(0, 1, exclude_max=True),
    base=st.floats(0.01, 5),
    cap=st.floats(5, 600),
    factor=st.floats(1, 4),
    jitter=st.floats(0, 0.99),
)
def test_every_wait_lies_within_its_jittered_ceiling_and_ceilings_never_shrink(
    attempt: int, draw: float, base: float, cap: float, factor: float, jitter: float
) -> None:
    b = Backoff(base, cap, factor, jitter)
    ceiling = b.ceiling(attempt)
    assert base <= ceiling <= cap
    assert ceiling * (1 - jitter) - 1e-9 <= b.delay(attempt, draw) <= ceiling
    assert b.ceiling(attempt + 1) >= ceiling


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"base_s": 0}, "0 < base_s <= cap_s"),
        ({"base_s": 40}, "0 < base_s <= cap_s"),
        ({"factor": 0.5}, "factor must be at least 1"),
        ({"jitter": 1.0}, "jitter must be in [0, 1)"),
    ],
)
def test_a_schedule_that_makes_no_sense_is_refused(kwargs: dict[str, float], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        Backoff(**kwargs)


def test_attempts_and_draws_outside_their_range_are_refused() -> None:
    with pytest.raises(ValueError, match="attempts count from 1"):
        Backoff().delay(0, 0.1)
    with pytest.raises(ValueError, match=r"draw must be in \[0, 1\)"):
        Backoff().delay(1, 1.0)
