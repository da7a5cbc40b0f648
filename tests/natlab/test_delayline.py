"""The WAN lab's delay line (pure: packets and `now` in, packets due out)."""

from __future__ import annotations

import random

import pytest

from tests.natlab.delayline import DelayLine, Shape

AB, BA = ("a", "b"), ("b", "a")


def line(shapes: dict | None = None, default: Shape | None = None, seed: int = 1) -> DelayLine:  # type: ignore[type-arg]
    return DelayLine(shapes or {}, default or Shape(), random.Random(seed))


def test_a_packet_is_held_for_its_edges_delay_and_no_longer() -> None:
    d = line({AB: Shape(delay=0.020)}, Shape(delay=0.005))
    assert d.push(b"x", AB, 1.000) and d.push(b"y", BA, 1.000)
    assert d.next_due() == pytest.approx(1.005)
    assert d.release(1.0049) == []
    assert d.release(1.005) == [b"y"]
    assert d.release(1.0199) == [] and d.next_due() == pytest.approx(1.020)
    assert d.release(1.020) == [b"x"] and d.next_due() is None and len(d) == 0


def test_an_edge_without_jitter_keeps_its_packets_in_order() -> None:
    d = line(default=Shape(delay=0.010))
    for i in range(100):
        d.push(bytes([i]), AB, 1.0 + i * 1e-4)
    assert d.release(2.0) == [bytes([i]) for i in range(100)]


def test_jitter_spreads_the_delay_but_does_not_reorder_unless_asked() -> None:
    shape = Shape(delay=0.020, jitter=0.010)
    d = line(default=shape)
    sent = [1.0 + i * 1e-3 for i in range(500)]
    for i, t in enumerate(sent):
        d.push(i.to_bytes(2, "big"), AB, t)
    got, times, t = [], [], 1.0
    while len(d):
        t = d.next_due() or t
        for p in d.release(t):
            got.append(int.from_bytes(p, "big"))
            times.append(t)
    assert got == list(range(500))
    held = [r - s for r, s in zip(times, sent, strict=True)]
    assert min(held) >= 0.010 - 1e-9 and max(held) > 0.025  # spread, none early
    r = line(default=Shape(delay=0.020, jitter=0.010, reorder=True))
    for i, t in enumerate(sent):
        r.push(i.to_bytes(2, "big"), AB, t)
    order = [int.from_bytes(p, "big") for p in r.release(9.0)]
    assert sorted(order) == list(range(500)) and order != list(range(500))


def test_loss_drops_about_its_share_and_counts_it() -> None:
    d = line(default=Shape(delay=0.001, loss=0.01), seed=7)
    kept = sum(d.push(b"p", AB, 1.0) for _ in range(20000))
    c = d.counts(AB)
    assert c.lost == 20000 - kept and c.passed == kept
    assert 150 <= c.lost <= 250, c  # 1% of 20000 = 200; 5 sigma is about +-70
    assert len(d.release(2.0)) == kept


def test_the_rate_cap_spaces_packets_past_the_burst_at_the_rate() -> None:
    rate = 1_000_000.0  # 1 MB/s
    d = line(default=Shape(delay=0.010, rate=rate, burst=10_000))
    for _ in range(30):
        d.push(bytes(1000), AB, 1.0)  # 30 kB at once: 10 kB burst, then 20 kB at 1 MB/s
    due = []
    while len(d):
        t = d.next_due()
        assert t is not None
        due += [t] * len(d.release(t))
    assert due[9] == pytest.approx(1.010)  # the burst leaves at once
    assert due[-1] == pytest.approx(1.010 + 20_000 / rate)
    assert due[20] - due[19] == pytest.approx(1000 / rate)


def test_a_full_rate_cap_queue_drops_the_tail() -> None:
    d = line(default=Shape(rate=1000.0, burst=1000, queue=2000))
    kept = [d.push(bytes(1000), AB, 0.0) for _ in range(6)]
    assert kept == [True, True, True, True, False, False]  # the burst + 2 s of queue (2000 B at 1 kB/s)
    assert d.counts(AB).overflowed == 2


def test_reshape_applies_to_new_packets_only() -> None:
    d = line(default=Shape(delay=0.040))
    d.push(b"old", AB, 0.0)
    d.reshape({}, Shape(delay=0.0))
    d.push(b"new", BA, 0.001)
    assert d.release(0.001) == [b"new"] and d.release(0.040) == [b"old"]


def test_bad_shapes_name_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"loss 1\.5"):
        Shape(loss=1.5)
    with pytest.raises(ValueError, match="rate 0"):
        Shape(rate=0)
