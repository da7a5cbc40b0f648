"""The head's scheduling core (pure): which request's chunk or decode step enters the ring next.

Requests are admitted up to the declared concurrency; more wait in a FIFO queue whose positions
are reported, up to `max_queue` of them (more are refused: QueueFull). An admitted request first
sends its prompt as prefill chunks (all of them at once: chunk k+1 can run at the head while chunk
k runs further along the ring; links keep them in order).
The last chunks of prompts admitted together travel as one step while their rows fit in `merge`
rows and the engine computes them with the same code as alone (`prefill_path`: a first chunk
does not share a step with a later one). `merge` defaults to a chunk; a head alone in its ring
lowers it to the rows up to which its engine computes every row of a step independently of the
others (`Stage.batch_rows`), so a prompt prefills to the same bits alone or with others. A head
with other stages after it sends each prompt as a step of its own (`SEPARATE_PROMPTS`): a merged
step keeps every stage busy for longer and no two stages can work on it at once, while separate
steps overlap along the ring. For m prompts through S stages of one prompt's time t, separate
steps finish the last after (m + S - 1) t, one merged step after S f(m) t, where f(m) is what m
prompts cost together (on the CPU about 1.5 for two 19-token prompts, 2.6 for four): in users.py's
three-member ring, the latest of four first tokens came at 0.34-0.35 s instead of 0.45-0.53 s.
Then a request
alternates: one decode step goes around the ring, comes back, is sampled, and the next step
becomes ready. Every request has at most one decode step in flight, unless it drafts ahead (below).

Decode steps travel in lanes. The ring keeps `lanes` groups of decode steps in flight at once;
each admitted request belongs to one lane (the emptiest when it is admitted), and a lane's next
step leaves, carrying every one of its requests that is ready, as soon as its previous step is
back. The requests of a lane therefore stay together step after step (one batch: they share
each stage's weight reads), and the lanes fill the pipeline (while one group computes at one
stage, the others compute at others). How many lanes: `lanes_for`, as many as the slowest
stage can serve while one group goes once around the ring. More would queue at that stage;
fewer would leave stages idle, and one group of every request (a convoy) pays for batching
without any overlap. Lanes that differ by two or more requests are evened out with a ready
request, so a lane emptied by finished requests does not idle while another carries several.
`continuation` says which step a returned lane sends next if all its requests go on, so the head
can compute it together with their tokens.

Speculative decoding: a request's decode step may carry `draft` tokens after its last one
(`set_draft`, kafila.engine.draft), one step of 1 + draft rows that verifies them; `sampled` then
counts the tokens the head kept (0 to draft + 1) and the next step starts after them, at the
position of the last one kept (the stages write over the rejected positions' KV from there).

Drafting ahead (`ahead`, PipeInfer's approach for one user): while a request's decode step is in
the ring, the head may send the next one, for the positions after it, on the assumption that the
step in flight keeps every drafted token and samples the token the head guessed
(`ahead_step`); up to `ahead` such steps per request, and only for a request alone in its lane
(its lane's other requests would wait for the chain). Steps of one request come back in the
order they left. When the step before holds, the one ahead is the request's next and its lane
stays busy; when it does not, the head voids every step ahead (`void_ahead`): they come back
unsampled, the request is ready again at the first rejected position, and its next step writes
over the voided positions on every stage. `circuits` numbers a request's decode steps, so an
ahead step drafted for one newest step is refused once another is newest.

No clocks, no I/O: the head loop calls `submit`, `take`, `returned`, `sampled`, `cancel`, and acts
on what they return.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kafila.engine import PREFILL_CHUNK


class State(Enum):
    QUEUED = "queued"
    PREFILL = "prefill"  # chunks not yet all sent
    IN_FLIGHT = "in_flight"  # a step (or the last prefill chunk) is in the ring
    READY = "ready"  # sampled; its next decode step can be sent
    DONE = "done"


@dataclass(frozen=True)
class Entry:
    request_id: int
    position: int  # sequence position of the first token in this step
    n_tokens: int


@dataclass(frozen=True)
class Step:
    """One frame into the ring: a prefill chunk of one request, or a batch of decode steps."""

    prefill: bool
    entries: tuple[Entry, ...]
    last_chunk: bool = False  # prefill: the head samples when this chunk returns


@dataclass
class _Request:
    rid: int
    prompt_len: int
    max_tokens: int
    state: State = State.QUEUED
    sent: int = 0  # prompt tokens already sent (prefill)
    generated: int = 0  # tokens sampled so far
    in_flight: int = 0  # steps in the ring
    cancelled: bool = False
    draft: int = 0  # tokens drafted for its next decode step
    flights: deque[tuple[int, int]] = field(default_factory=deque)  # its valid decode steps in the
    # ring, in order: (position, rows); more than one only with steps ahead
    void: int = 0  # voided steps ahead still in the ring (they come back before any valid one)
    circuits: int = 0  # decode steps sent, voided ones included
    sampling: bool = False  # a step of it came back and its tokens are not counted yet


SEPARATE_PROMPTS = 1  # `merge` rows for a ring of several stages: prompts never share a step


class QueueFull(Exception):
    """Every slot is taken and the queue holds `max_queue` requests: refuse (HTTP 429)."""


@dataclass
class Schedule:
    concurrency: int
    chunk: int = PREFILL_CHUNK  # prefill chunk, tokens
    lanes: int = 1  # decode groups in flight at once (see `lanes_for`)
    merge: int = 0  # rows up to which last prefill chunks of several prompts share a step (0: chunk)
    max_queue: int | None = None  # requests that may wait for a slot (None: no limit)
    ahead: int = 0  # decode steps a request may have in the ring ahead of its next one (drafting ahead)
    # the engine's code path for chunks beginning at these positions (Stage.prefill_path): last
    # chunks share a step only when they take the same one (None: one path for all)
    prefill_path: Callable[[Sequence[int]], object] | None = None
    _reqs: dict[int, _Request] = field(default_factory=dict)
    _queue: deque[int] = field(default_factory=deque)
    _active: list[int] = field(default_factory=list)  # admission order
    _freed: list[int] = field(default_factory=list)  # requests whose KV the stages may drop
    _lane: dict[int, int] = field(default_factory=dict)  # admitted request -> its lane
    _busy: set[int] = field(default_factory=set)  # lanes with a decode step in the ring

    def __post_init__(self) -> None:
        least = min(self.merge, self.max_queue or 0, self.ahead)
        if min(self.concurrency, self.chunk, self.lanes) < 1 or least < 0:
            raise ValueError(
                f"concurrency {self.concurrency}, chunk {self.chunk} and lanes {self.lanes} "
                f"must be at least 1, merge {self.merge}, max_queue {self.max_queue} and ahead "
                f"{self.ahead} at least 0"
            )
        self.merge = min(self.merge or self.chunk, self.chunk)

    def submit(self, rid: int, prompt_len: int, max_tokens: int) -> int:
        """Queue a request; returns its queue position (0: admitted now). QueueFull when it would
        have to wait and `max_queue` requests already do."""
        if rid in self._reqs:
            raise ValueError(f"request {rid} is already scheduled")
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError(
                f"request {rid}: prompt of {prompt_len} and max_tokens {max_tokens} must be >= 1"
            )
        if self._full():
            slots = f"{self.concurrency} slot{'s' if self.concurrency != 1 else ''}"
            if not self.max_queue:
                raise QueueFull(f"all {slots} of this session are busy and it queues no request")
            raise QueueFull(
                f"the session's queue is full: {len(self._queue)} requests already wait for its {slots}"
            )
        self._reqs[rid] = _Request(rid, prompt_len, max_tokens)
        self._queue.append(rid)
        self._admit()
        return self.queue_position(rid)

    def _full(self) -> bool:
        if self.max_queue is None:
            return False
        waiting = len(self._queue) + (len(self._active) >= self.concurrency)  # + this one, if it waits
        return waiting > self.max_queue

    def queue_position(self, rid: int) -> int:
        return self._queue.index(rid) + 1 if rid in self._queue else 0

    def queue_positions(self) -> dict[int, int]:
        return {rid: i + 1 for i, rid in enumerate(self._queue)}

    @property
    def active(self) -> tuple[int, ...]:
        return tuple(self._active)

    def lane_sizes(self) -> list[int]:
        """Admitted requests per lane."""
        counts = Counter(self._lane.values())
        return [counts[lane] for lane in range(self.lanes)]

    def take(self) -> list[Step]:
        """Everything that can enter the ring now: prefill chunks first, then one decode group
        from every lane whose previous step is back, of its requests that are ready."""
        chunks = [c for rid in list(self._active) for c in self._chunks(self._reqs[rid])]
        steps = [c for c in chunks if not c.last_chunk] + self._merged([c for c in chunks if c.last_chunk])
        self._even_out()
        ready = self._ready()
        for lane in range(self.lanes):
            if lane in self._busy:
                continue
            group = [r for r in ready if self._lane[r.rid] == lane]
            if not group:
                continue
            entries = tuple(Entry(r.rid, r.prompt_len + r.generated - 1, 1 + r.draft) for r in group)
            for r, e in zip(group, entries, strict=True):
                r.state, r.in_flight, r.circuits = State.IN_FLIGHT, r.in_flight + 1, r.circuits + 1
                r.flights.append((e.position, e.n_tokens))
            self._busy.add(lane)
            steps.append(Step(False, entries))
        return steps

    def _ready(self) -> list[_Request]:
        return [self._reqs[rid] for rid in self._active if self._reqs[rid].state is State.READY]

    def _even_out(self) -> None:
        """Move ready requests (not in the ring) from the fullest lane to the emptiest while they
        differ by two or more."""
        while True:
            sizes = self.lane_sizes()
            small, big = sizes.index(min(sizes)), sizes.index(max(sizes))
            movable = [r for r in self._ready() if self._lane[r.rid] == big]
            if sizes[big] - sizes[small] < 2 or not movable:
                return
            self._lane[movable[-1].rid] = small

    def _merged(self, lasts: list[Step]) -> list[Step]:
        """Last chunks of several requests as few steps of at most `merge` rows, in order: each joins
        the latest step on its code path (`prefill_path`) while the rows fit, else starts one."""
        out: list[Step] = []
        for c in lasts:
            same = [i for i, prev in enumerate(out) if self._path(prev) == self._path(c)]
            if same and sum(e.n_tokens for e in out[same[-1]].entries + c.entries) <= self.merge:
                out[same[-1]] = Step(True, out[same[-1]].entries + c.entries, last_chunk=True)
            else:
                out.append(c)
        return out

    def _path(self, step: Step) -> object:
        return self.prefill_path([e.position for e in step.entries]) if self.prefill_path else None

    def _chunks(self, r: _Request) -> list[Step]:
        out = []
        while r.state is State.PREFILL:
            n = min(self.chunk, r.prompt_len - r.sent)
            last = r.sent + n == r.prompt_len
            out.append(Step(True, (Entry(r.rid, r.sent, n),), last_chunk=last))
            r.sent += n
            r.in_flight += 1
            if last:
                r.state = State.IN_FLIGHT
        return out

    def returned(self, step: Step) -> list[int]:
        """A step came back to the head: the requests to sample now (cancelled ones and voided
        steps ahead are dropped). Its lane is free again unless a step ahead of it is in the ring."""
        out, lanes, held = [], {self._lane.get(e.request_id) for e in step.entries}, False
        for e in step.entries:
            r = self._reqs.get(e.request_id)
            if r is None:
                continue
            r.in_flight -= 1
            void = False
            if not step.prefill and r.void:
                r.void, void = r.void - 1, True
            elif not step.prefill and r.flights:
                r.flights.popleft()
                r.sampling = True
            held = held or void or bool(r.flights)
            if r.state is State.DONE:
                self._maybe_forget(r)
            elif not void and (not step.prefill or step.last_chunk):
                out.append(r.rid)
        if not step.prefill and not held:
            self._busy.difference_update(lanes)
        return out

    def ahead_room(self, rid: int) -> int:
        """The most rows a decode step sent ahead for `rid` now may have (`ahead_step`), 0 where
        none may leave: drafting ahead is off, the request is not alone in its lane, its newest
        step carries no draft (a plain step: its guess would likely miss), `ahead` steps are
        already ahead, or the tokens assumed leave it none to take."""
        r = self._reqs.get(rid)
        if r is None or r.state is not State.IN_FLIGHT or not r.flights or r.sampling:
            return 0
        if len(r.flights) > self.ahead or r.flights[-1][1] < 2 or self.lane_sizes()[self._lane[rid]] != 1:
            return 0
        return max(0, r.max_tokens - self._assumed(r))

    def _assumed(self, r: _Request) -> int:
        """Tokens `r` has once every valid step in the ring keeps all it carries and its guess."""
        return r.generated + sum(rows for _, rows in r.flights)

    def ahead_step(self, rid: int, circuits: int, rows: int) -> Step | None:
        """A decode step of `rows` rows sent for `rid` after its newest one, assuming that one
        keeps its whole draft and samples the guessed token this step starts with. `circuits`:
        the request's `circuits` when the step was drafted; None (nothing sent) where another
        step is newest since, or the request can no longer take it (`ahead_room`)."""
        r = self._reqs.get(rid)
        if r is None or r.circuits != circuits or not 1 <= rows <= self.ahead_room(rid):
            return None
        position = r.prompt_len + self._assumed(r) - 1
        r.in_flight, r.circuits = r.in_flight + 1, r.circuits + 1
        r.flights.append((position, rows))
        return Step(False, (Entry(rid, position, rows),))

    def circuits(self, rid: int) -> int:
        """Decode steps sent for `rid` so far (0 for an unknown one)."""
        r = self._reqs.get(rid)
        return 0 if r is None else r.circuits

    def void_ahead(self, rid: int) -> int:
        """The step of `rid` that came back did not give what the steps ahead of it assumed: they
        are void (dropped when they come back) and its lane is free for its next step, which
        starts at the first position it did not keep. Returns how many were voided."""
        r = self._reqs.get(rid)
        if r is None or not r.flights:
            return 0
        n = len(r.flights)
        r.void, r.flights = r.void + n, deque()
        self._busy.discard(self._lane.get(rid))
        return n

    def set_draft(self, rid: int, n: int) -> None:
        """`rid`'s next decode step carries `n` drafted tokens after its last one."""
        r = self._reqs.get(rid)
        if r is None:
            return
        room = r.max_tokens - r.generated - 1
        if not 0 <= n <= max(room, 0):
            raise ValueError(f"request {rid}: a draft of {n} tokens with {r.max_tokens - r.generated} left")
        r.draft = n

    def sampled(self, rid: int, stop: bool, n: int = 1) -> bool:
        """`n` tokens were sampled for `rid` (0: a verification step kept none and its position is
        sampled again); returns True when the request is finished."""
        r = self._reqs[rid]
        r.generated, r.sampling = r.generated + n, False
        if stop or r.generated >= r.max_tokens:
            self.void_ahead(rid)
            self._finish(r)
            return True
        if r.flights and r.flights[0][0] != r.prompt_len + r.generated - 1:
            at, want = r.flights[0][0], r.prompt_len + r.generated - 1
            raise ValueError(f"request {rid}: its step ahead starts at {at}, its tokens end at {want}")
        r.state = State.IN_FLIGHT if r.flights else State.READY
        return False

    def continuation(self, step: Step) -> Step | None:
        """The decode step `take` will send for the lane of `step`, a decode step that came back
        (after `returned`, before `sampled`), if every request of it goes on and nothing else
        happens first: the head runs it while the tokens it needs are sampled (RingHead). None
        where `take` would send something else: the lane holds another request that is ready (it
        joins this step), a request is gone or ends by length now, or `_even_out` would move one."""
        if step.prefill or not step.entries:
            return None
        reqs = [r for e in step.entries if (r := self._reqs.get(e.request_id)) is not None]
        if len(reqs) < len(step.entries) or any(r.state is not State.IN_FLIGHT or r.in_flight for r in reqs):
            return None  # cancelled meanwhile
        if any(r.generated + 1 >= r.max_tokens for r in reqs):
            return None  # the token sampled now is its last
        lane = self._lane[reqs[0].rid]
        if any(self._lane[r.rid] != lane for r in reqs) or any(
            self._lane[r.rid] == lane for r in self._ready()
        ):
            return None
        sizes = self.lane_sizes()
        if max(sizes) - min(sizes) >= 2:
            return None
        group = sorted(reqs, key=lambda r: self._active.index(r.rid))  # take's order
        return Step(False, tuple(Entry(r.rid, r.prompt_len + r.generated, 1) for r in group))

    def next_position(self, rid: int) -> int:
        """The position `rid`'s next decode step starts at (its last sampled token's)."""
        r = self._reqs[rid]
        return r.prompt_len + r.generated - 1

    def cancel(self, rid: int) -> bool:
        """Drop a request; returns True when it had been admitted (its KV is freed through
        `pop_freed` once nothing of it is left in the ring)."""
        r = self._reqs.get(rid)
        if r is None or r.state is State.DONE:
            return False
        if rid in self._queue:
            self._queue.remove(rid)
            del self._reqs[rid]
            return False
        r.cancelled = True
        self._finish(r)
        return True

    def lost(self, rid: int) -> None:
        """The ring broke with steps of cancelled request `rid` in it: none of them comes back,
        so it leaves `active` now rather than wait for them for good."""
        r = self._reqs.get(rid)
        if r is not None and r.state is State.DONE:
            r.in_flight, r.void, r.flights = 0, 0, deque()
            self._maybe_forget(r)

    def idle(self, rid: int) -> bool:
        r = self._reqs.get(rid)
        return r is None or r.in_flight == 0

    def pop_freed(self) -> list[int]:
        """Requests that left the ring since the last call: send their `free` before any new step."""
        out, self._freed = self._freed, []
        return out

    def _finish(self, r: _Request) -> None:
        r.state = State.DONE
        self._maybe_forget(r)

    def _maybe_forget(self, r: _Request) -> None:
        """A finished request keeps its slot until none of its steps is left in the ring, so a
        stage never holds more than `concurrency` requests' KV caches."""
        if r.state is State.DONE and r.in_flight == 0:
            self._reqs.pop(r.rid, None)
            if r.rid in self._active:
                self._active.remove(r.rid)
                self._freed.append(r.rid)
                del self._lane[r.rid]
            self._admit()

    def _admit(self) -> None:
        while self._queue and len(self._active) < self.concurrency:
            rid = self._queue.popleft()
            sizes = self.lane_sizes()
            self._lane[rid] = sizes.index(min(sizes))
            self._active.append(rid)
            self._reqs[rid].state = State.PREFILL


def lanes_for(circuit: float | None, slowest: float | None, stages: int) -> int:
    """Decode groups a ring should keep in flight: as many as its slowest stage can serve while
    one group goes once around, at least 1. `circuit` and `slowest` are the plan's predicted
    circuit (every stage plus every hop) and bottleneck stage, in any one unit: 88 ms around a
    29 ms stage gives 3, 80 around a 40 ms head gives 2, a ring of one gives 1. Without
    predictions: one lane per stage."""
    if stages < 1:
        raise ValueError("a ring has at least one stage")
    if not circuit or not slowest:
        return stages
    return max(1, int(circuit // slowest))
