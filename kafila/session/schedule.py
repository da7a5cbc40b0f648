"""The head's scheduling core (pure): which request's chunk or decode step enters the ring next.

Requests are admitted up to the declared concurrency; more wait in a FIFO queue whose positions
are reported. An admitted request first sends its prompt as prefill chunks (all of them at once:
chunk k+1 can run at the head while chunk k runs further along the ring; links keep them in order),
then alternates: one decode step goes around the ring, comes back, is sampled, and the next step
becomes ready. Every request has at most one decode step in flight.

Decode steps that are ready at the same moment leave in groups. One group of every request would
travel the ring as a convoy, leaving all stages but one idle; one group per request reads every
stage's weights once per request. The schedule keeps `lanes` groups in the ring: one per stage and
one more, for the group that is on a link or at the head's sampler while the others compute (a
ring of one member has nothing to overlap: one lane). Groups are as large as they can be while
there are at least that many (batching, which shares each stage's weight reads): four users on
three stages leave as four groups of one, eight as four groups of two.

No clocks, no I/O: the head loop calls `submit`, `take`, `returned`, `sampled`, `cancel`, and acts
on what they return.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum


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


@dataclass
class Schedule:
    concurrency: int
    chunk: int = 256  # prefill chunk, tokens
    stages: int = 1  # members in the ring: sizes the decode groups
    _reqs: dict[int, _Request] = field(default_factory=dict)
    _queue: deque[int] = field(default_factory=deque)
    _active: list[int] = field(default_factory=list)  # admission order
    _freed: list[int] = field(default_factory=list)  # requests whose KV the stages may drop

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.chunk < 1 or self.stages < 1:
            raise ValueError(
                f"concurrency {self.concurrency}, chunk {self.chunk} and stages {self.stages} "
                "must be at least 1"
            )

    def submit(self, rid: int, prompt_len: int, max_tokens: int) -> int:
        """Queue a request; returns its queue position (0: admitted now)."""
        if rid in self._reqs:
            raise ValueError(f"request {rid} is already scheduled")
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError(
                f"request {rid}: prompt of {prompt_len} and max_tokens {max_tokens} must be >= 1"
            )
        self._reqs[rid] = _Request(rid, prompt_len, max_tokens)
        self._queue.append(rid)
        self._admit()
        return self.queue_position(rid)

    def queue_position(self, rid: int) -> int:
        return self._queue.index(rid) + 1 if rid in self._queue else 0

    def queue_positions(self) -> dict[int, int]:
        return {rid: i + 1 for i, rid in enumerate(self._queue)}

    @property
    def active(self) -> tuple[int, ...]:
        return tuple(self._active)

    @property
    def lanes(self) -> int:
        """Groups the ring can work on at once: one per stage, one more in transit (1 alone)."""
        return self.stages + 1 if self.stages > 1 else 1

    @property
    def group_size(self) -> int:
        """Most decode steps in one frame: the largest size that still makes `lanes` groups of the
        active requests (ceil(active / size) >= lanes), at least 1."""
        active, size = len(self._active), max(1, len(self._active))
        while size > 1 and -(-active // size) < self.lanes:
            size -= 1
        return size

    def take(self) -> list[Step]:
        """Everything that can enter the ring now: prefill chunks first, then the decode groups."""
        steps = [c for rid in list(self._active) for c in self._chunks(self._reqs[rid])]
        ready = [self._reqs[rid] for rid in self._active if self._reqs[rid].state is State.READY]
        for r in ready:
            r.state, r.in_flight = State.IN_FLIGHT, r.in_flight + 1
        size = self.group_size
        for at in range(0, len(ready), size):
            group = ready[at : at + size]
            steps.append(Step(False, tuple(Entry(r.rid, r.prompt_len + r.generated - 1, 1) for r in group)))
        return steps

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
        """A step came back to the head: the requests to sample now (cancelled ones are dropped)."""
        out = []
        for e in step.entries:
            r = self._reqs.get(e.request_id)
            if r is None:
                continue
            r.in_flight -= 1
            if r.state is State.DONE:
                self._maybe_forget(r)
            elif not step.prefill or step.last_chunk:
                out.append(r.rid)
        return out

    def sampled(self, rid: int, stop: bool) -> bool:
        """One token was sampled for `rid`; returns True when the request is finished."""
        r = self._reqs[rid]
        r.generated += 1
        if stop or r.generated >= r.max_tokens:
            self._finish(r)
            return True
        r.state = State.READY
        return False

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
            self._admit()

    def _admit(self) -> None:
        while self._queue and len(self._active) < self.concurrency:
            rid = self._queue.popleft()
            self._active.append(rid)
            self._reqs[rid].state = State.PREFILL
