"""The head's scheduling core against random interleavings of arrivals, returns and cancels."""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.session.ring.schedule import Entry, QueueFull, Schedule, Step, lanes_for


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


def test_a_full_queue_refuses_naming_the_numbers_and_takes_again_once_one_leaves() -> None:
    s = Schedule(concurrency=2, chunk=8, max_queue=2)
    assert [s.submit(rid, 4, 4) for rid in (1, 2, 3, 4)] == [0, 0, 1, 2]
    with pytest.raises(QueueFull, match="2 requests already wait for its 2 slots"):
        s.submit(5, 4, 4)
    assert s.queue_positions() == {3: 1, 4: 2}  # the refused one left nothing behind
    s.cancel(3)
    assert s.submit(5, 4, 4) == 2


def test_a_session_without_a_queue_refuses_only_when_every_slot_is_taken() -> None:
    s = Schedule(concurrency=1, chunk=8, max_queue=0)
    assert s.submit(1, 4, 4) == 0
    with pytest.raises(QueueFull, match="all 1 slot of this session are busy and it queues no request"):
        s.submit(2, 4, 4)
    s.cancel(1)
    assert s.submit(2, 4, 4) == 0


def test_queue_positions_and_admission_when_a_slot_frees() -> None:
    s = Schedule(concurrency=2, chunk=8)
    assert [s.submit(i, 3, 1) for i in range(1, 6)] == [0, 0, 1, 2, 3]
    assert s.queue_positions() == {3: 1, 4: 2, 5: 3}
    [step] = s.take()  # both short prompts in one prefill step
    assert [e.request_id for e in step.entries] == [1, 2] and step.last_chunk
    assert s.returned(step) == [1, 2]
    assert s.sampled(1, stop=True) is True
    assert s.queue_positions() == {4: 1, 5: 2}
    assert s.active == (2, 3)


def test_last_chunks_of_prompts_admitted_together_share_steps_up_to_a_chunk() -> None:
    s = Schedule(concurrency=4, chunk=8)
    for rid, n in [(1, 3), (2, 12), (3, 4), (4, 2)]:
        s.submit(rid, n, 5)
    steps = s.take()
    shapes = [(st.last_chunk, [(e.request_id, e.position, e.n_tokens) for e in st.entries]) for st in steps]
    assert shapes == [
        (False, [(2, 0, 8)]),  # a long prompt's earlier chunks go first, alone
        (True, [(1, 0, 3), (2, 8, 4)]),  # 7 rows
        (True, [(3, 0, 4), (4, 0, 2)]),  # 4 more would make 11 > 8: a new step
    ]
    assert [s.returned(st) for st in steps] == [[], [1, 2], [3, 4]]


def test_last_chunks_share_steps_only_up_to_the_merge_rows() -> None:
    s = Schedule(concurrency=3, chunk=8, merge=5)
    for rid, n in [(1, 3), (2, 2), (3, 1)]:
        s.submit(rid, n, 5)
    assert [[e.request_id for e in st.entries] for st in s.take()] == [[1, 2], [3]]  # 6 rows > 5
    with pytest.raises(ValueError, match="merge -1"):
        Schedule(concurrency=1, merge=-1)
    assert Schedule(concurrency=1, chunk=8, merge=64).merge == 8  # never more than a chunk


def test_last_chunks_share_a_step_only_on_the_same_code_path() -> None:
    """A first chunk (position 0) and a later one run different code in the engine (first chunks:
    one compiled call per block): they never share a step, and each joins the latest step on its
    own path while the rows fit."""

    def path(starts) -> str:
        return "first" if all(p == 0 for p in starts) else "later"

    s = Schedule(concurrency=5, chunk=8, prefill_path=path)
    for rid, n in [(1, 3), (2, 12), (3, 4), (4, 10), (5, 2)]:
        s.submit(rid, n, 5)
    shapes = [[(e.request_id, e.position) for e in st.entries] for st in s.take() if st.last_chunk]
    assert shapes == [[(1, 0), (3, 0)], [(2, 8), (4, 8)], [(5, 0)]]  # 7 rows, 6 rows, then 7 + 2 > 8


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


def _prefilled(s: Schedule, n_reqs: int) -> None:
    """Submit n_reqs requests (prompt 3 + rid) and bring each back from its prefill."""
    for rid in range(n_reqs):
        s.submit(rid, 3 + rid, 10)
    for step in s.take():
        for rid in s.returned(step):
            s.sampled(rid, stop=False)


@pytest.mark.parametrize(
    ("n_reqs", "lanes", "groups"),
    [
        (4, 2, [[0, 2], [1, 3]]),
        (4, 3, [[0, 3], [1], [2]]),
        (4, 4, [[0], [1], [2], [3]]),
        (4, 1, [[0, 1, 2, 3]]),
        (3, 5, [[0], [1], [2]]),
        (8, 3, [[0, 3, 6], [1, 4, 7], [2, 5]]),
    ],
)
def test_ready_decode_steps_leave_one_group_per_lane(
    n_reqs: int, lanes: int, groups: list[list[int]]
) -> None:
    s = Schedule(concurrency=n_reqs, chunk=16, lanes=lanes)
    _prefilled(s, n_reqs)
    taken = s.take()
    assert [[e.request_id for e in g.entries] for g in taken] == groups
    assert all(not g.prefill and e.position == 3 + e.request_id for g in taken for e in g.entries)
    # a group that comes back leaves again whole, and only its lane leaves: the others are in the ring
    for rid in s.returned(taken[0]):
        s.sampled(rid, stop=False)
    assert [[e.request_id for e in g.entries] for g in s.take()] == [groups[0]]


def test_a_lane_waits_for_its_step_so_late_requests_join_the_next_one() -> None:
    s = Schedule(concurrency=2, chunk=16, lanes=1)
    s.submit(1, 4, 10)
    [p1] = s.take()
    s.submit(2, 4, 10)
    [p2] = s.take()
    for rid in s.returned(p1):
        s.sampled(rid, stop=False)
    [d1] = s.take()
    assert d1.entries == (Entry(1, 4, 1),)  # the lane was free: request 1 leaves alone
    for rid in s.returned(p2):
        s.sampled(rid, stop=False)
    assert s.take() == []  # request 2 is ready, but its lane's step is in the ring
    for rid in s.returned(d1):
        s.sampled(rid, stop=False)
    [d2] = s.take()
    assert d2.entries == (Entry(1, 5, 1), Entry(2, 4, 1))  # from now on they travel together


def test_lanes_are_evened_out_when_requests_finish() -> None:
    s = Schedule(concurrency=4, chunk=16, lanes=2)
    _prefilled(s, 4)  # lanes: [0, 2] and [1, 3]
    a, b = s.take()
    for rid in s.returned(a):
        s.sampled(rid, stop=True)  # 0 and 2 finish: lane 0 is empty
    for rid in s.returned(b):
        s.sampled(rid, stop=False)
    assert s.lane_sizes() == [0, 2]
    taken = s.take()
    assert sorted(len(g.entries) for g in taken) == [1, 1]  # one of lane 1's moved over
    assert s.lane_sizes() == [1, 1]


def test_new_requests_join_the_emptiest_lane() -> None:
    s = Schedule(concurrency=3, chunk=16, lanes=2)
    _prefilled(s, 2)
    assert s.lane_sizes() == [1, 1]
    s.submit(9, 3, 5)
    assert s.lane_sizes() == [2, 1]
    s.cancel(0)  # ready, not in the ring: forgotten at once
    assert s.lane_sizes() == [1, 1]
    taken = s.take()
    assert [(g.prefill, [e.request_id for e in g.entries]) for g in taken] == [(True, [9]), (False, [1])]


def test_the_continuation_of_a_returned_step_is_what_take_sends_next() -> None:
    s = Schedule(concurrency=4, chunk=16, lanes=2)
    _prefilled(s, 4)  # lanes [0, 2] and [1, 3]
    a, b = s.take()
    s.returned(a)
    nxt = s.continuation(a)
    assert nxt == Step(False, (Entry(0, 4, 1), Entry(2, 6, 1)))
    for rid in (0, 2):
        s.sampled(rid, stop=False)
    assert s.take() == [nxt]
    assert s.continuation(b) is None  # not yet returned: its requests are in the ring


def test_no_continuation_where_take_would_send_something_else() -> None:
    s = Schedule(concurrency=2, chunk=16, lanes=1)
    s.submit(1, 4, 3)
    [p1] = s.take()
    assert s.returned(p1) == [1]
    assert s.continuation(p1) is None  # a prefill chunk
    s.sampled(1, stop=False)
    [d1] = s.take()
    s.submit(2, 4, 10)  # joins the lane while d1 is in the ring
    [p2] = s.take()
    s.returned(p2)
    s.sampled(2, stop=False)  # ready, waiting for the lane
    s.returned(d1)
    assert s.continuation(d1) is None  # request 2 joins the lane's next step
    s.sampled(1, stop=False)
    [d2] = s.take()
    assert d2.entries == (Entry(1, 5, 1), Entry(2, 4, 1))
    s.returned(d2)
    assert s.continuation(d2) is None  # request 1's token sampled now is its third and last
    s.cancel(2)
    assert s.continuation(d2) is None


@pytest.mark.parametrize(
    ("circuit_ms", "slowest_ms", "stages", "lanes"),
    [
        (86.5, 29.0, 3, 2),  # stages 28, 29, 28 and hops of 0.5
        (87.0, 28.0, 3, 3),  # stages 28, 28, 28 and hops of 1
        (80.0, 40.0, 3, 2),  # a 40 ms head and two stages of 20
        (48.0, 10.0, 4, 4),  # four stages of 10 and hops of 2
        (30.0, 30.0, 1, 1),
        (None, None, 3, 3),  # no predictions: one lane per stage
    ],
)
def test_lanes_for_fills_the_ring_up_to_its_slowest_stage(
    circuit_ms: float | None, slowest_ms: float | None, stages: int, lanes: int
) -> None:
    assert lanes_for(circuit_ms, slowest_ms, stages) == lanes


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


def test_a_cancelled_request_whose_ring_broke_leaves_active_at_once() -> None:
    s = Schedule(concurrency=1, chunk=16)
    s.submit(1, 4, 10)
    s.take()  # its prefill is in the ring
    assert s.cancel(1) is True and s.active == (1,)  # waiting for its step to come back
    s.lost(7)  # a request the schedule does not hold: nothing happens
    s.lost(1)  # the ring broke: the step never comes back
    assert s.active == () and s.pop_freed() == [1]


def test_bad_arguments_are_refused_with_numbers() -> None:
    with pytest.raises(ValueError, match="concurrency 0"):
        Schedule(concurrency=0)
    with pytest.raises(ValueError, match="lanes 0"):
        Schedule(concurrency=2, lanes=0)
    with pytest.raises(ValueError, match="at least one stage"):
        lanes_for(10.0, 5.0, 0)
    s = Schedule(concurrency=1)
    with pytest.raises(ValueError, match="prompt of 0"):
        s.submit(1, 0, 5)


@settings(max_examples=150, deadline=None)
@given(
    concurrency=st.integers(1, 4),
    chunk=st.integers(1, 6),
    lanes=st.integers(1, 4),
    reqs=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6)), min_size=1, max_size=8),
    seed=st.integers(0, 2**32),
)
def test_random_interleavings_keep_the_invariants(
    concurrency: int, chunk: int, lanes: int, reqs: list[tuple[int, int]], seed: int
) -> None:
    rng = random.Random(seed)
    s = Schedule(concurrency=concurrency, chunk=chunk, lanes=lanes)
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
            ring += taken
            decoding = [g for g in ring if not g.prefill]
            assert len(decoding) <= lanes  # never more decode groups in the ring than lanes
            assert all(len(g.entries) <= -(-concurrency // lanes) for g in decoding)
            for rid in s.pop_freed():
                assert s.idle(rid)
            if ring:
                step = ring.pop(rng.randrange(len(ring)) if rng.random() < 0.2 else 0)
                for e in step.entries:
                    sent[e.request_id].append((e.position, e.n_tokens))
                back = s.returned(step)
                guess, stops = s.continuation(step), False
                for rid in back:
                    stop = rng.random() < 0.1
                    stops = stops or stop
                    if s.sampled(rid, stop):
                        finished.add(rid)
                if guess is not None and not stops:  # what the head computed ahead is sent next
                    taken = s.take()
                    assert guess in taken
                    ring += taken
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


def test_a_drafted_step_carries_its_draft_and_the_next_starts_after_the_tokens_kept() -> None:
    s = Schedule(concurrency=1, chunk=8)
    s.submit(1, prompt_len=5, max_tokens=10)
    [p] = s.take()
    s.returned(p)
    s.sampled(1, stop=False)  # the first token, at position 5
    s.set_draft(1, 3)
    [d] = s.take()
    assert d == Step(False, (Entry(1, 5, 4),))  # the last token and three drafted
    s.returned(d)
    assert s.next_position(1) == 5
    assert s.sampled(1, stop=False, n=3) is False  # two drafts kept and the model's own token
    s.set_draft(1, 0)
    [d] = s.take()
    assert d == Step(False, (Entry(1, 8, 1),))
    s.returned(d)
    assert s.sampled(1, stop=False, n=0) is False  # a near tie: the position is sampled again
    [d] = s.take()
    assert d == Step(False, (Entry(1, 8, 1),))
    s.returned(d)
    s.sampled(1, stop=False)
    with pytest.raises(ValueError, match="request 1: a draft of 5 tokens with 5 left"):
        s.set_draft(1, 5)  # five tokens left: the step's own and four drafted at most
    s.set_draft(1, 4)
    [d] = s.take()
    assert d == Step(False, (Entry(1, 9, 5),))
    s.returned(d)
    assert s.sampled(1, stop=False, n=5) is True  # max_tokens reached


def _drafting_request(s: Schedule, max_tokens: int = 20) -> Step:
    """Request 1 (prompt of 5) prefilled, its first token sampled, its step of 2 drafts sent."""
    s.submit(1, prompt_len=5, max_tokens=max_tokens)
    [p] = s.take()
    s.returned(p)
    s.sampled(1, stop=False)
    s.set_draft(1, 2)
    [d] = s.take()
    assert d == Step(False, (Entry(1, 5, 3),))
    return d


def test_a_step_ahead_starts_after_the_step_in_flight_and_is_the_next_when_that_holds() -> None:
    s = Schedule(concurrency=1, chunk=8, ahead=1)
    d = _drafting_request(s)
    assert s.ahead_room(1) == 20 - 1 - 3  # the tokens left once the step in flight keeps all three
    a = s.ahead_step(1, s.circuits(1), 2)
    assert a == Step(False, (Entry(1, 8, 2),))  # its guess at 8, one draft after it
    assert s.ahead_room(1) == 0  # one step ahead at most
    assert s.take() == []
    assert s.returned(d) == [1]
    assert s.take() == [] and s.ahead_room(1) == 0  # its tokens are not counted yet
    assert s.sampled(1, stop=False, n=3) is False  # both drafts and the guess kept
    assert s.take() == []  # the step ahead is its next step, in the ring already
    assert s.ahead_room(1) == 20 - 1 - 3 - 2
    assert s.returned(a) == [1]
    assert s.sampled(1, stop=False, n=1) is False
    s.set_draft(1, 0)
    assert s.take() == [Step(False, (Entry(1, 9, 1),))]


def test_a_step_that_does_not_hold_voids_the_steps_ahead_and_the_next_writes_over_them() -> None:
    s = Schedule(concurrency=1, chunk=8, ahead=2)
    d = _drafting_request(s)
    a1 = s.ahead_step(1, s.circuits(1), 3)
    assert a1 == Step(False, (Entry(1, 8, 3),))
    a2 = s.ahead_step(1, s.circuits(1), 2)
    assert a2 == Step(False, (Entry(1, 11, 2),))
    assert s.returned(d) == [1]
    assert s.void_ahead(1) == 2  # it kept one draft, then sampled another token
    assert s.sampled(1, stop=False, n=2) is False
    s.set_draft(1, 1)
    [c] = s.take()
    assert c == Step(False, (Entry(1, 7, 2),))  # before the voided positions: written over
    assert s.ahead_room(1) > 0  # a new chain may start from the corrected step
    assert s.returned(a1) == [] and s.returned(a2) == []  # void: not sampled
    assert s.take() == []  # the corrected step is still in the ring: its lane stays busy
    assert s.returned(c) == [1]
    assert s.sampled(1, stop=False, n=2) is False
    assert s.take() == [Step(False, (Entry(1, 9, 2),))]


def test_a_step_ahead_is_refused_where_its_assumption_is_stale_or_it_would_not_pay() -> None:
    s = Schedule(concurrency=2, chunk=8, ahead=1)
    d = _drafting_request(s, max_tokens=6)
    drafted_for = s.circuits(1)
    assert s.ahead_room(1) == 6 - 1 - 3
    assert s.ahead_step(1, drafted_for, 3) is None  # more rows than tokens left
    s.returned(d)
    s.void_ahead(1)
    s.sampled(1, stop=False, n=1)
    assert s.ahead_step(1, drafted_for, 1) is None  # its step came back meanwhile
    s.set_draft(1, 0)
    s.take()
    assert s.ahead_room(1) == 0  # a plain step: nothing drafted, no guess worth sending
    s.submit(2, prompt_len=3, max_tokens=4)
    assert Schedule(concurrency=1, ahead=0).ahead_room(1) == 0
    lone = Schedule(concurrency=2, chunk=8, ahead=1)
    _drafting_request(lone)
    lone.submit(2, prompt_len=3, max_tokens=4)  # the same lane: request 1 no longer drafts ahead
    assert lone.ahead_room(1) == 0
    with pytest.raises(ValueError, match="ahead -1 at least 0"):
        Schedule(concurrency=1, ahead=-1)


def test_a_request_that_ends_voids_its_steps_ahead_and_keeps_its_slot_until_they_return() -> None:
    s = Schedule(concurrency=1, chunk=8, ahead=1)
    d = _drafting_request(s)
    a = s.ahead_step(1, s.circuits(1), 2)
    assert a is not None
    s.submit(2, prompt_len=3, max_tokens=4)
    s.returned(d)
    assert s.sampled(1, stop=True, n=2) is True  # a stop token among the drafts
    assert s.active == (1,) and s.pop_freed() == []
    assert s.returned(a) == []
    assert s.pop_freed() == [1] and s.active == (2,)


@given(
    ahead=st.integers(1, 3),
    n_reqs=st.integers(1, 3),
    lanes=st.integers(1, 2),
    seed=st.integers(0, 2**32),
)
@settings(max_examples=60, deadline=None)
def test_random_drafts_ahead_keep_every_cache_as_the_tokens_kept(
    ahead: int, n_reqs: int, lanes: int, seed: int
) -> None:
    """A simulated head and stage around the schedule: requests draft (right or wrong) and send
    steps ahead on random guesses; every step writes its positions into the request's cache as a
    stage does (from its start, dropping what lay after), steps come back in the order they left.
    Each valid step that comes back saw a cache holding exactly the prompt and the tokens kept
    before it, and every request ends with the tokens the model gives."""
    rng = random.Random(seed)
    s = Schedule(concurrency=n_reqs, chunk=4, lanes=lanes, ahead=ahead)
    prompt = {rid: [100 + rid] * rng.randint(1, 6) for rid in range(n_reqs)}
    model = {rid: [rng.randrange(3) for _ in range(40)] for rid in range(n_reqs)}  # its answer
    most = {rid: rng.randint(1, 15) for rid in range(n_reqs)}
    tokens: dict[int, list[int]] = {rid: [] for rid in range(n_reqs)}
    cache: dict[int, list[int]] = {rid: [] for rid in range(n_reqs)}
    flights: dict[int, deque[list[int]]] = {rid: deque() for rid in range(n_reqs)}
    ring: deque[tuple[Step, dict[int, list[int]]]] = deque()
    for rid in range(n_reqs):
        s.submit(rid, len(prompt[rid]), most[rid])

    def guess(rid: int, at: int, n: int) -> list[int]:  # the model's tokens from answer index `at`, or misses
        return [model[rid][at + i] if rng.random() < 0.8 else 9 for i in range(n)]

    def send(step: Step, fed: dict[int, list[int]]) -> None:
        for e in step.entries:
            assert e.position <= len(cache[e.request_id])  # a stage refuses a gap
            cache[e.request_id][e.position :] = fed[e.request_id]
            if not step.prefill:
                flights[e.request_id].append(fed[e.request_id])
        ring.append((step, {rid: list(cache[rid]) for rid in fed}))

    while s.active or ring:
        for step in s.take():
            if step.prefill:
                fed = {
                    e.request_id: prompt[e.request_id][e.position : e.position + e.n_tokens]
                    for e in step.entries
                }
            else:
                fed = {}
                for e in step.entries:
                    r = e.request_id
                    fed[r] = [tokens[r][-1], *guess(r, len(tokens[r]), e.n_tokens - 1)]
            send(step, fed)
        for rid in s.active:
            room = s.ahead_room(rid)
            if room:
                rows = rng.randint(1, room)
                after = len(cache[rid]) - len(prompt[rid])  # the answer index its guess stands at
                step = s.ahead_step(rid, s.circuits(rid), rows)
                assert step is not None and step.entries[0].position == len(cache[rid])
                send(step, {rid: guess(rid, after, rows)})
        if not ring:
            continue
        step, seen = ring.popleft()
        back = s.returned(step)
        for rid in back:
            known = prompt[rid] + tokens[rid]
            if step.prefill:
                got: list[int] = [model[rid][0]]
                fed_draft: list[int] = []
            else:
                fed_draft = flights[rid].popleft()[1:]
                e = next(e for e in step.entries if e.request_id == rid)
                assert seen[rid][: e.position + 1] == known  # the valid step saw what was kept
                got = []
                for i, d in enumerate([*fed_draft, None]):
                    got.append(model[rid][len(tokens[rid]) + i])
                    if got[-1] != d:
                        break
            got = got[: most[rid] - len(tokens[rid])]
            held = bool(flights[rid]) and got == [*fed_draft, flights[rid][0][0]]
            if flights[rid] and not held:
                s.void_ahead(rid)
                flights[rid].clear()
            tokens[rid] += got
            done = s.sampled(rid, stop=False, n=len(got))
            if not done and not flights[rid]:
                s.set_draft(rid, rng.randint(0, max(0, min(3, most[rid] - len(tokens[rid]) - 1))))
        assert len(s.active) <= n_reqs
    for rid in range(n_reqs):
        assert tokens[rid] == model[rid][: most[rid]]
