"""The head's scheduling core against random interleavings of arrivals, returns and cancels."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.session.schedule import Entry, Schedule, Step


def test_prefill_chunks_then_one_decode_step_at_a_time() -> None:
    s = Schedule(concurrency=1, chunk=4)
    assert s.submit(1, prompt_len=10, max_tokens=3) == 0
    steps = s.take()
    assert [(st.prefill, st.entries, st.last_chunk) for st in steps] == [
        (True, (Entry(1, 0, 4),), False),
        (True, (Entry(1, 4, 4),), False),
        (True, (Entry(1, 8, 2),), True),
    ]
    assert s.take() == []
    assert s.returned(steps[0]) == [] and s.returned(steps[1]) == []
    assert s.returned(steps[2]) == [1]
    assert s.sampled(1, stop=False) is False
    [d] = s.take()
    assert d == Step(False, (Entry(1, 10, 1),))
    assert s.take() == []  # its next step waits for this one to come back
    assert s.returned(d) == [1]
    assert s.sampled(1, stop=False) is False
    [d] = s.take()
    assert d.entries == (Entry(1, 11, 1),)
    s.returned(d)
    assert s.sampled(1, stop=False) is True  # max_tokens = 3 reached
    assert s.pop_freed() == [1]


def test_queue_positions_and_admission_when_a_slot_frees() -> None:
    s = Schedule(concurrency=2, chunk=8)
    assert [s.submit(i, 3, 1) for i in range(1, 6)] == [0, 0, 1, 2, 3]
    assert s.queue_positions() == {3: 1, 4: 2, 5: 3}
    steps = s.take()
    assert [st.entries[0].request_id for st in steps] == [1, 2]
    s.returned(steps[0])
    assert s.sampled(1, stop=True) is True
    assert s.queue_positions() == {4: 1, 5: 2}
    assert s.active == (2, 3)


def test_ready_decode_steps_leave_as_one_batch() -> None:
    s = Schedule(concurrency=3, chunk=16)
    for rid, n in [(1, 5), (2, 7), (3, 2)]:
        s.submit(rid, n, 10)
    for step in s.take():
        for rid in s.returned(step):
            s.sampled(rid, stop=False)
    [batch] = s.take()
    assert not batch.prefill
    assert batch.entries == (Entry(1, 5, 1), Entry(2, 7, 1), Entry(3, 2, 1))


@pytest.mark.parametrize(
    ("n_reqs", "stages", "sizes"),
    [
        (4, 3, [1, 1, 1, 1]),
        (8, 3, [2, 2, 2, 2]),
        (7, 3, [2, 2, 2, 1]),
        (12, 3, [3, 3, 3, 3]),
        (4, 1, [4]),
        (4, 4, [1, 1, 1, 1]),
        (5, 2, [2, 2, 1]),
        (3, 5, [1, 1, 1]),
    ],
)
def test_ready_decode_steps_leave_in_groups_filling_one_lane_per_stage_and_one_more(
    n_reqs: int, stages: int, sizes: list[int]
) -> None:
    s = Schedule(concurrency=n_reqs, chunk=16, stages=stages)
    for rid in range(n_reqs):
        s.submit(rid, 3 + rid, 10)
    for step in s.take():
        for rid in s.returned(step):
            s.sampled(rid, stop=False)
    groups = s.take()
    assert [len(g.entries) for g in groups] == sizes
    assert [e.request_id for g in groups for e in g.entries] == list(range(n_reqs))  # each once, in order
    assert all(e.position == 3 + e.request_id for g in groups for e in g.entries)
    # a group that comes back alone leaves again as one group: sizes do not decay to one request
    for rid in s.returned(groups[0]):
        s.sampled(rid, stop=False)
    assert [len(g.entries) for g in s.take()] == [sizes[0]]


def test_cancelled_request_keeps_its_slot_until_its_step_returns() -> None:
    s = Schedule(concurrency=1, chunk=16)
    s.submit(1, 4, 10)
    s.submit(2, 4, 10)
    [p] = s.take()
    assert s.cancel(1) is True
    assert s.take() == []  # request 2 must not start while 1 is still in the ring
    assert s.returned(p) == []  # dropped, not sampled
    assert s.pop_freed() == [1]
    [p2] = s.take()
    assert p2.entries == (Entry(2, 0, 4),)
    assert s.cancel(7) is False


def test_bad_arguments_are_refused_with_numbers() -> None:
    with pytest.raises(ValueError, match="concurrency 0"):
        Schedule(concurrency=0)
    with pytest.raises(ValueError, match="stages 0"):
        Schedule(concurrency=2, stages=0)
    s = Schedule(concurrency=1)
    with pytest.raises(ValueError, match="prompt of 0"):
        s.submit(1, 0, 5)


@settings(max_examples=150, deadline=None)
@given(
    concurrency=st.integers(1, 4),
    chunk=st.integers(1, 6),
    stages=st.integers(1, 4),
    reqs=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6)), min_size=1, max_size=8),
    seed=st.integers(0, 2**32),
)
def test_random_interleavings_keep_the_invariants(
    concurrency: int, chunk: int, stages: int, reqs: list[tuple[int, int]], seed: int
) -> None:
    rng = random.Random(seed)
    s = Schedule(concurrency=concurrency, chunk=chunk, stages=stages)
    sent: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(reqs))}
    finished, cancelled, ring = set(), set(), []
    pending = list(enumerate(reqs))
    while pending or ring or s.active or s.queue_positions():
        action = rng.random()
        if pending and action < 0.3:
            rid, (plen, mx) = pending.pop(0)
            s.submit(rid, plen, mx)
        elif action < 0.35 and s.active:
            rid = rng.choice(s.active)
            if rid not in finished:
                s.cancel(rid)
                cancelled.add(rid)
        else:
            taken = s.take()
            most = concurrency if stages == 1 else max(1, concurrency // stages)  # lanes - 1 == stages
            assert all(len(st.entries) <= most for st in taken if not st.prefill)
            ring += taken
            for rid in s.pop_freed():
                assert s.idle(rid)
            if ring:
                step = ring.pop(rng.randrange(len(ring)) if rng.random() < 0.2 else 0)
                for e in step.entries:
                    sent[e.request_id].append((e.position, e.n_tokens))
                for rid in s.returned(step):
                    stop = rng.random() < 0.1
                    if s.sampled(rid, stop):
                        finished.add(rid)
        assert len(s.active) <= concurrency
        in_ring = [e.request_id for st in ring if not st.prefill for e in st.entries]
        assert len(in_ring) == len(set(in_ring))  # at most one decode step per request in flight
    for rid, (plen, mx) in enumerate(reqs):
        covered = sorted(sent[rid])
        pos = 0
        for p, n in covered:
            assert p == pos  # each position exactly once, no gap
            pos += n
        if rid in finished and rid not in cancelled:
            assert plen <= pos <= plen + mx - 1
    assert finished | cancelled == set(range(len(reqs)))
