"""The ring head: admits requests, embeds and runs its blocks, samples what comes back.

The head is a GenerationService. Requests come from its own API (`submit`) and from other members
(Generate messages that travelled the ring to it). The pure `Schedule` says which prefill chunks
and decode steps enter the ring; one pump task runs them on the model thread and queues the frames
for the next member; one receive task takes frames back from the last member, samples on the model
thread and answers. The model thread's turn that samples a lane's tokens also runs the lane's next
step when the schedule will send it (`Schedule.continuation`), so a decode step leaves the head
without a trip through the event loop between its token and its compute. Every message to the
next member goes through one outbox, so frees, frames and tokens keep their order. A channel that
breaks fails every request within the heartbeat's window with a `member_lost` error that names the
member.

Speculative decoding (a `draft` policy, kafila.engine.draft): each decode step of a request may
carry the tokens prompt lookup (or the head's draft model, kafila.engine.draft_model) drafts
after its last one; the model thread's turn verifies them
on the rows that come back (kafila.engine.speculative), answers with every token kept, and drafts
the request's next step. The other members only see a decode step of several rows: a step that
starts before what they cached writes over the rejected positions.

Drafting ahead (the policy's `ahead`, --draft-ahead): while a request's step is in the ring, the
head drafts past it, assuming its whole draft is kept and guessing the token it samples, and
sends up to `ahead` more steps for the positions after it (kafila.session.ring.schedule,
compute.ahead_steps). A step that comes back giving what the step ahead assumed makes that one
its next, already on its way; otherwise the steps ahead are void (their results are dropped when
they come back) and the request's next step starts at its first rejected position, which every
stage writes over.

Traces: the head writes its own `StageRecord` as every member does (kafila.session.ring.stagetrace) and,
once the request's `free` notice has come back around the ring carrying every member's hop
figures, the `RequestRecord` with the whole ring's view (a ring of one writes it at once; a broken
ring writes what it has). Metrics are fed from the same records.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kafila.api.service import STOP_STRING, GenerationError, Sampling, TokenEvent
from kafila.engine import PREFILL_CHUNK
from kafila.engine.draft import DraftPolicy, DraftStats, Proposer, observe, observe_drafting
from kafila.engine.draft_model import DraftModel
from kafila.engine.sampler import Sampler, SamplingParams, StopReason
from kafila.engine.speculative import holds
from kafila.engine.stage import Stage, StageError
from kafila.obs import hopmarks, metrics
from kafila.obs.log import get_logger
from kafila.obs.trace import HopTrace, RequestRecord, StageRecord, StageTrace, TraceLog
from kafila.planner.decide import as_planned, measured
from kafila.planner.drafting import MIN_CIRCUITS, CircuitCounts
from kafila.planner.plan import Plan
from kafila.proto import ring as rc
from kafila.proto import tensor as t
from kafila.session.channel import Channel, ChannelError
from kafila.session.ring import compute
from kafila.session.ring.generation import QueueGeneration, cancel_tasks, guarded
from kafila.session.ring.info import RingInfo
from kafila.session.ring.origins import RequestIds, first_origins, origin_of
from kafila.session.ring.role import RoleBase
from kafila.session.ring.schedule import SEPARATE_PROMPTS, Entry, QueueFull, Schedule, Step
from kafila.session.ring.stagetrace import StageTally, read_hop_report

log = get_logger("kafila.session.ring.head")

# a greedy row computed with others whose best two logits lie closer than this is sampled alone
# (kafila.engine.speculative), where a backend does not promise each row the bits of a one-row step
TIE_MARGIN = 1e-2
QUEUE_REPORT_S = 0.25  # queue positions are sent at most this often (only those that changed)


@dataclass(frozen=True)
class _Flight:
    """A decode step of a request in the ring: the token it feeds first (the last sampled, or a
    step ahead's guess), the drafted ones after it, and when it left the head."""

    first: int
    draft: tuple[int, ...]
    sent_at: float


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    sampler: Sampler
    generation: QueueGeneration | None  # local requests; None: answer over the ring
    max_tokens: int
    queued_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_at: float | None = None
    last_at: float | None = None
    last_token: int = 0
    generated: int = 0
    sent_at: float = 0.0
    circuit_s: list[float] = field(default_factory=list)
    stage_us: list[tuple[int, ...]] = field(default_factory=list)  # per decode step, every stage
    prefill_us: list[tuple[int, ...]] = field(default_factory=list)  # per prefill chunk, every stage
    transit_ms: list[float] = field(default_factory=list)  # per decode step: circuit - compute
    rows: int = 0
    finish: str = "stop"
    tokens: list[int] = field(default_factory=list)  # every token sampled so far (fed back, or the last)
    feed: list[int] | None = None  # carried into a new epoch: prompt + tokens, prefilled again
    asker: str = ""  # the member whose client asked, where the origin tag names another (a spare's)
    draft: tuple[int, ...] = ()  # drafted tokens its next (or in-flight) decode step carries
    draft_stats: DraftStats = field(default_factory=DraftStats)
    drafted: int = 0  # draft tokens verified, in all
    accepted: int = 0  # ... and kept
    circuits: int = 0  # decode steps that came back
    flights: deque[_Flight] = field(default_factory=deque)  # its valid decode steps in the ring, in order

    def fed(self) -> list[int]:
        """What its prefill feeds the ring: the prompt, or after a re-plan the prompt and its tokens."""
        return self.prompt if self.feed is None else self.feed


class RingHead(RoleBase):
    def __init__(
        self,
        stage: Stage,
        model: compute.ModelThread,
        info: RingInfo,
        next_ch: Channel | None,
        prev_ch: Channel | None,
        eos_ids: Sequence[int] = (),
        concurrency: int = 1,
        chunk: int = PREFILL_CHUNK,
        traces: TraceLog | None = None,
        lanes: int = 1,  # decode groups in flight (schedule.lanes_for, from the plan)
        max_queue: int | None = None,  # requests that may wait for a slot (None: no limit)
        origins: Mapping[str, int] | None = None,  # each member's origin tag (None: first ring index)
        draft: DraftPolicy | None = None,  # speculative decoding with prompt lookup (None: off)
        tie_margin: float | None = None,  # kafila.engine.speculative's (None: 0 where rows are exact)
        drafter: DraftModel | None = None,  # drafts instead of prompt lookup (with a `draft` policy)
    ) -> None:
        super().__init__(info.order[0], next_ch, prev_ch)
        self.draft, self.drafter = draft, drafter
        self.tie_margin = tie_margin
        self.last_request = (0, 0, 0)  # decode circuits, drafted and kept tokens of the last one done
        self.counts = CircuitCounts()  # every decode circuit of this head's requests, every epoch
        self.plan: Plan | None = None  # the plan it serves, repriced for `counts` in /session
        self.stage, self.model, self.info = stage, model, info
        self.eos_ids = tuple(eos_ids)
        # prompts admitted together: in a ring of one, one step of as many rows as stay exact; in a
        # longer ring one step each, so the stages overlap them (Schedule, SEPARATE_PROMPTS)
        merge = SEPARATE_PROMPTS if next_ch is not None else stage.batch_rows or 0
        self.schedule = Schedule(
            concurrency, chunk, lanes, merge, max_queue, self._ahead_steps(next_ch), stage.prefill_path
        )
        log.info("decode_lanes", lanes=self.schedule.lanes, concurrency=concurrency)
        self.traces = traces
        self.origins = dict(first_origins(info.order) if origins is None else origins)  # name -> tag now
        self.asked_by = {tag: name for name, tag in self.origins.items()}  # every tag ever: who asked
        self.ids = RequestIds(self.origins[self.name])
        self._lanes, self._concurrency = lanes, concurrency
        self._reqs: dict[int, _Req] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.tally = StageTally(info, 0, next_ch, prev_ch)
        self._pending: dict[int, _Pending] = {}  # recorded here, waiting for the members' hop reports
        self._ending: dict[int, _Req] = {}  # taken out (cancelled, failed), steps of them still in the ring
        self._told: dict[int, int] = {}  # the queue position each waiting request was last told
        self._queue_report: asyncio.TimerHandle | None = None
        self._ahead: tuple[Step, tuple[bytes, int, int]] | None = None  # a continuation already run
        self.ahead_sent = 0  # continuations run with the sampling and sent as they were
        self.ahead_dropped = 0  # ... and dropped: the schedule took another step (a cancel meanwhile)
        self._first: asyncio.Future[float] | None = None  # the next token's time.monotonic(), if asked
        self._drafting_ahead: set[int] = set()  # requests whose steps ahead the model thread drafts
        self.drafted_ahead = 0  # decode steps sent ahead of their request's step in the ring
        self.voided_ahead = 0  # ... voided: the step before them did not give what they assumed
        self.voided_rows = 0  # ... and the rows they carried (compute spent for nothing)
        self.refused_ahead = 0  # drafted ahead, then not sent: the step before came back first
        self.decode_rows = 0  # rows of every decode step sent, voided ones included

    def _ahead_steps(self, next_ch: Channel | None) -> int:
        """Steps a request may send ahead: the policy's, in a ring of several members."""
        return self.draft.ahead if self.draft is not None and next_ch is not None else 0

    # -- GenerationService -------------------------------------------------------------------------

    @property
    def context(self) -> int:
        return self.stage.context

    async def submit(self, prompt: Sequence[int], sampling: Sampling, asker: str = "") -> QueueGeneration:
        """Take a request of this member's API; `asker`: the member whose client asked, where it is
        not this one (a spare's request the host relays), as the records name it."""
        rid = self.ids.next()
        gen = QueueGeneration(rid, self._cancel_local)
        self._accept(rid, list(prompt), sampling, gen, asker=asker)
        return gen

    def describe(self) -> dict[str, Any]:
        return (
            self.document()
            | {
                "me": self.info.order[0],  # the head, as a member's document names itself
                "active": list(self.schedule.active),
                "queued": len(self.schedule.queue_positions()),
                "slots": self.schedule.concurrency,  # KV-cache slots: requests admitted at once
                "lanes": self.schedule.lane_sizes(),  # admitted requests per decode lane
            }
            | self._yield_document()
        )

    def priced(self) -> Plan | None:
        """The plan it serves priced for the tokens its circuits gave (`counts`) once it counted
        MIN_CIRCUITS of them, each drafted row at the row share its stages measured, else at its
        draft policy's (plain figures before; None: no plan given)."""
        if self.plan is None:
            return None
        return measured(self.plan, self.counts, self.assumed_share())

    def assumed_share(self) -> float:
        return 0.0 if self.draft is None else self.draft.row_share

    def _yield_document(self) -> dict[str, Any]:
        """/session's "decode" (the counts) and "plan" with the chosen plan's figures priced for
        them (`priced`: as planned until they count MIN_CIRCUITS circuits) next to the figures as
        planned, one token per circuit ("planned")."""
        c, share = self.counts, self.counts.row_share()
        y = c.circuit_yield(self.assumed_share())
        decode = {
            "circuits": c.circuits,
            "drafted": c.drafted,
            "accepted": c.accepted,
            "tokens_per_circuit": round(y.tokens, 4),
            "rows_per_circuit": round(y.rows, 4),
            "row_share": round(y.row_share, 4),
            "row_share_from": "assumed" if share is None else "measured",
            "prices_plan": c.circuits >= MIN_CIRCUITS,
        }
        priced = self.priced()
        if priced is None or self.plan is None:
            return {"decode": decode}
        planned = as_planned(self.plan).summary()
        return {"decode": decode, "plan": {**self.info.plan, "chosen": priced.summary(), "planned": planned}}

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> RingHead:
        loops = [self._pump]
        if self.next is not None and self.prev is not None:
            loops += [self._send_out, self._receive, self._watch_stall]
        if self.next is not None and self.next is not self.prev:
            loops.append(self._watch_next)
        self._tasks = [guarded(c, self.name, self._internal_error) for c in loops]
        return self

    async def stop(self) -> None:
        await self.pause()
        self._fail_all("internal", "the session is shutting down")
        self._flush_pending()

    async def pause(self) -> None:
        """Stop this epoch's loops; requests stay (kafila.session.forming.epochs carries them on)."""
        if self._queue_report is not None:
            self._queue_report.cancel()
            self._queue_report = None
        await cancel_tasks(self._tasks)
        self._ahead = None

    def go(self) -> None:
        for req in self._reqs.values():  # answers lost on the way when the ring broke, made good
            if req.generation is None and req.tokens and self.next is not None:
                self._outbox.put_nowait(rc.control(rc.Resync(req.rid, tuple(req.tokens))))
        self._wake.set()

    def first_token(self) -> asyncio.Future[float]:
        """When (time.monotonic()) the next token is sampled: the first one a re-plan resumed."""
        self._first = asyncio.get_running_loop().create_future()
        return self._first

    def resume(
        self,
        epoch: int,
        stage: Stage,
        info: RingInfo,
        next_ch: Channel | None,
        prev_ch: Channel | None,
        lanes: int,
        origins: Mapping[str, int] | None = None,
    ) -> int:
        """Serve epoch `epoch` on `stage` and these channels, carrying every request on: each one
        admitted is prefilled again with its prompt and the tokens it has (its KV cache rebuilt on
        the new ring; its sampler kept, so a greedy answer goes on as it would have), queued ones
        keep their places. Requests forwarded by a member the new ring leaves out are dropped: no
        answer could reach its clients (a member counted lost fails them itself when it wakes; one
        come back under its name has a new origin tag, `origins`, the host's for every member).
        Returns how many requests were carried."""
        if origins is not None:
            self.origins = dict(origins)
            self.asked_by |= {tag: name for name, tag in origins.items()}
        old = self.schedule
        carried = [*old.active, *old.queue_positions()]
        for rid in list(self._ending):  # their frees will not come round: record what is known
            self._record(self._ending.pop(rid))
        orphans = [rid for rid in carried if self._asked_from_outside(rid, info)]
        for rid in orphans:
            orphan = self._reqs.pop(rid)
            orphan.finish = "cancelled"
            self._record(orphan)
        if orphans:
            log.info("requests_dropped", epoch=epoch, count=len(orphans), reason="their member left the ring")
        carried = [rid for rid in carried if rid not in orphans]
        self._flush_pending()
        self._retire(next_ch, prev_ch)
        self.stage, self.info, self.next, self.prev, self.epoch = stage, info, next_ch, prev_ch, epoch
        merge = SEPARATE_PROMPTS if next_ch is not None else stage.batch_rows or 0
        self.schedule = Schedule(
            self._concurrency,
            old.chunk,
            lanes,
            merge,
            old.max_queue,
            self._ahead_steps(next_ch),
            stage.prefill_path,
        )
        self.tally = StageTally(info, 0, next_ch, prev_ch)
        self._outbox = asyncio.Queue()
        for rid in carried:
            req = self._reqs.get(rid)
            if req is None or len(req.tokens) >= req.max_tokens:
                continue
            req.feed = req.prompt + req.tokens
            req.sampler, req.draft = req.sampler.rewound(req.prompt, req.tokens), ()
            req.flights = deque()
            self.schedule.submit(rid, len(req.feed), req.max_tokens - len(req.tokens))
        self.broken = None
        self.start()  # its pump sends once the state is "serving" again (`go`)
        return len(carried)

    def carrying(self) -> int:
        """Requests this head holds: admitted and queued."""
        return len(self.schedule.active) + len(self.schedule.queue_positions())

    def _asked_from_outside(self, rid: int, info: RingInfo) -> bool:
        """Whether request `rid` came from a member that `info`'s ring leaves out: no member of
        it has the request's origin tag (a member that left and came back has another)."""
        req = self._reqs.get(rid)
        if req is None or req.generation is not None:
            return False
        return origin_of(rid) not in {self.origins.get(name) for name in info.order}

    # -- admission -------------------------------------------------------------------------------------

    def _accept(
        self,
        rid: int,
        prompt: list[int],
        s: Sampling,
        gen: QueueGeneration | None,
        had: Sequence[int] | None = None,
        asker: str = "",
    ) -> None:
        """Take request `rid`; `had`: it was carried from a head that was lost, with these tokens
        already streamed to its client (taken while re-planning too: its client waits on it)."""
        if had is None or self.state != "replanning":
            self.refuse_new()
        had = list(had or ())
        if not prompt or len(prompt) + s.max_tokens > self.context:
            raise GenerationError(
                "too_long",
                f"prompt of {len(prompt)} tokens plus max_tokens={s.max_tokens} exceeds the context of "
                f"{self.context} tokens",
            )
        if len(had) >= s.max_tokens:
            raise GenerationError(
                "bad_request", f"request {rid} carried {len(had)} tokens, max_tokens={s.max_tokens}"
            )
        problem = self.stage.config.token_problem(prompt + had)
        if problem:  # the embedding would fail in the model thread and break the ring
            raise GenerationError("bad_request", problem)
        try:  # the API checked these; a forwarded request is checked here too, never breaking the ring
            params = SamplingParams(
                temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                max_tokens=s.max_tokens, stop_token_ids=s.stop_ids, repeat_penalty=s.repeat_penalty,
                repeat_last_n=s.repeat_last_n, presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty, min_p=s.min_p,
            )  # fmt: skip
            sampler = Sampler(params, self.eos_ids, prompt)
        except ValueError as exc:
            raise GenerationError("bad_request", str(exc)) from exc
        sampler.replay(had)
        try:
            position = self.schedule.submit(rid, len(prompt) + len(had), s.max_tokens - len(had))
        except QueueFull as exc:
            log.info("request_refused", request_id=rid, reason="queue full")
            metrics.observe_no_token("refused")
            raise GenerationError("busy", f"{exc}; try again later") from exc
        req = _Req(rid, prompt, sampler, gen, s.max_tokens, asker=asker)
        if had:  # prefilled with what its client has, then on from there
            req.tokens, req.generated, req.feed = had, len(had), prompt + had
        self._reqs[rid] = req
        if position:
            self._told[rid] = position
            self._answer(req, TokenEvent(queue_position=position))
        log.info(
            "request_accepted", request_id=rid, prompt_tokens=len(prompt), queue_position=position,
            **({"carried_tokens": len(had)} if had else {}), **({"asker": asker} if asker else {}),
        )  # fmt: skip
        self._wake.set()

    def adopt(self, msg: t.Generate, gen: QueueGeneration) -> None:
        """A request this member's own API forwarded to a head that was lost, carried on here as a
        local one: `msg.generated` are the tokens `gen` has streamed."""
        gen.answered_by(self._cancel_local)
        try:
            self._accept(msg.request_id, list(msg.prompt), Sampling.of(msg), gen, msg.generated, msg.asker)
        except GenerationError as exc:
            gen.push(exc)

    def _accept_remote(self, msg: t.Generate) -> None:
        if msg.request_id in self._reqs:  # sent again after a re-plan: it was carried on
            if not self.schedule.queue_position(msg.request_id):
                self._outbox.put_nowait(t.Tokens(msg.request_id, ()))
            return
        had = msg.generated if msg.carried else None  # carried from a head that was lost
        try:
            self._accept(msg.request_id, list(msg.prompt), Sampling.of(msg), None, had, msg.asker)
        except GenerationError as exc:
            self._outbox.put_nowait(t.Error(msg.request_id, exc.code, exc.message))
            return
        if not self.schedule.queue_position(msg.request_id):  # queued ones were told their place
            self._outbox.put_nowait(t.Tokens(msg.request_id, ()))  # admitted: the member may answer 200

    def _cancel_local(self, rid: int, reason: str) -> None:
        self._cancel(rid, reason)

    def _cancel(self, rid: int, reason: str) -> None:
        req = self._reqs.pop(rid, None)
        if req is None:
            return
        log.info("request_cancelled", request_id=rid, reason=reason, generated=req.generated)
        self._end(req, "stop" if reason == STOP_STRING else "cancelled")
        self._report_queue()
        self._wake.set()

    def _end(self, req: _Req, finish: str) -> None:
        """Take a request out before its answer is done; it is recorded (its frames crossed every hop)
        once none of its steps is left in the ring, or now if it never entered."""
        req.finish = finish
        if self.schedule.cancel(req.rid):
            self._ending[req.rid] = req
        else:
            self._record(req)

    # -- the pump: what enters the ring ---------------------------------------------------------------

    async def _pump(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._advance()

    async def _advance(self) -> None:
        """Free what finished, then send every step the schedule lets in: the one computed in the
        sampling turn first (`_ahead`), the others through the model thread. The pump calls it when
        woken; the receive task calls it too, right after sampling, so a lane's next decode step
        leaves before any other task runs (the sampled token's consumer, say)."""
        if self.state != "serving":  # held for a re-plan: nothing more enters this epoch's ring
            return
        freed = self.schedule.pop_freed()
        if freed:
            await self.model.run(compute.close_slots, self.stage, freed, self.drafter)
            for rid in freed:
                if (ended := self._ending.pop(rid, None)) is not None:
                    self._record(ended)
                self.tally.discard(rid)  # (a finished request's counts were taken at its last token)
            if self.next is not None:
                self._outbox.put_nowait(rc.control(rc.Free(tuple(freed))))
            self._report_queue()
        steps = self.schedule.take()
        ahead, self._ahead = self._ahead, None  # run for one of these steps, or stale
        if ahead is not None and ahead[0] in steps:
            self.ahead_sent += 1
            steps.remove(ahead[0])
            await self._dispatch(*ahead)  # before the others: it is computed, they are not
        elif ahead is not None:
            self.ahead_dropped += 1
        for step in steps:
            await self._enter(step)
        await self._draft_ahead()

    async def _draft_ahead(self) -> None:
        """Send steps ahead for every request the schedule lets (`Schedule.ahead_room`): drafted
        and computed on the model thread on the history its steps in the ring assume, then sent
        unless a step of it came back meanwhile (the schedule refuses them: `circuits` moved on,
        or its tokens are being counted; the head's own cache is written over by its next step,
        which starts no later than they would have)."""
        if self.draft is None or not self.schedule.ahead or self.state != "serving":
            return
        for rid in self.schedule.active:
            room = self.schedule.ahead_room(rid)
            req = self._reqs.get(rid)
            if not room or req is None or not req.flights or rid in self._drafting_ahead:
                continue
            assumed = [*req.prompt, *req.tokens, *req.flights[0].draft]
            for f in list(req.flights)[1:]:
                assumed += [f.first, *f.draft]
            room = min(room, self.context - 1 - len(assumed))
            count = self.schedule.ahead + 1 - len(req.flights)
            ahead = compute.Ahead(rid, assumed, req.draft_stats, room, count, *self._draft_model_calls(rid))
            circuits = self.schedule.circuits(rid)
            self._drafting_ahead.add(rid)
            try:
                made = await self.model.run(compute.ahead_steps, self.stage, self.draft, ahead)
            finally:
                self._drafting_ahead.discard(rid)
            if self.state != "serving":  # held for a re-plan meanwhile: the next epoch starts over
                return
            for i, a in enumerate(made):
                step = self.schedule.ahead_step(rid, circuits + i, len(a.tokens))
                if step is None:
                    self.refused_ahead += len(made) - i
                    break
                if step.entries[0].position != a.position:
                    raise RuntimeError(
                        f"request {rid}: a step drafted ahead at position {a.position}, "
                        f"the schedule sends it at {step.entries[0].position}"
                    )
                req.draft_stats = observe_drafting(self.draft, req.draft_stats, len(a.tokens), a.draft_s)
                self.drafted_ahead += 1
                await self._dispatch(step, a.out, a.tokens)

    async def _enter(self, step: Step) -> None:
        tokens = [self._tokens_for(e, step.prefill) for e in step.entries]
        entries = _wire_entries(step)
        taken = time.perf_counter()  # its queue ends here: the head's own compute is prefill
        for e in step.entries:
            if (req := self._reqs.get(e.request_id)) is not None:
                req.admitted_at = req.admitted_at or taken
        hopmarks.mark("submit", entries)
        try:
            data, rows, us = await self.model.run(
                compute.head_step, self.stage, entries, tokens, not step.prefill
            )
        except StageError as exc:
            self._fail_step(step, "internal", str(exc))
            return
        await self._dispatch(step, (data, rows, us))

    async def _dispatch(self, step: Step, out: tuple[bytes, int, int], fed: tuple[int, ...] = ()) -> None:
        """The head's output of `step` (wire bytes of `rows` rows, computed in `us`) to the next
        member; `fed`: what a step sent ahead (of one request) feeds."""
        data, rows, us = out
        entries = _wire_entries(step)
        hopmarks.mark("back", entries)
        now = time.perf_counter()
        for e in step.entries:
            req = self._reqs.get(e.request_id)
            if req is not None and step.prefill:
                self.tally.add(e.request_id, us, prefill=True)
            if req is not None:
                req.sent_at, req.rows = now, req.rows + e.n_tokens
            if req is not None and not step.prefill:
                first, draft = (fed[0], fed[1:]) if fed else (req.last_token, req.draft)
                req.flights.append(_Flight(first, draft, now))
                self.decode_rows += e.n_tokens
        flags = (t.Flag.PREFILL if step.prefill else 0) | (t.Flag.LAST_CHUNK if step.last_chunk else 0)
        wire = compute.wire_dtype(self.stage)
        frame = t.Hidden(0, wire, (rows, self.stage.model.config.hidden_size), entries, data, flags, (us,))
        if self.next is None:
            await self._returned(frame)
        else:
            self._outbox.put_nowait(frame)
            if step.prefill and step.last_chunk and self.drafter is not None:
                for e in step.entries:  # the draft model reads the prompt while its prefill is in the ring
                    if (req := self._reqs.get(e.request_id)) is not None:
                        self.model.post(self.drafter.catch_up, e.request_id, req.fed())

    def _tokens_for(self, e: Entry, prefill: bool) -> list[int]:
        req = self._reqs.get(e.request_id)
        if req is None:  # cancelled between take() and now: its rows still keep positions in order
            return [0] * e.n_tokens
        return req.fed()[e.position : e.position + e.n_tokens] if prefill else [req.last_token, *req.draft]

    # -- what comes back -------------------------------------------------------------------------------

    async def _receive(self) -> None:
        assert self.prev is not None
        try:
            while True:
                msg = await self.prev.recv()
                if isinstance(msg, t.Hidden) and self.state != "serving":
                    continue  # held for a re-plan: the next epoch computes it again
                if isinstance(msg, t.Hidden):
                    await self._returned(msg)
                elif isinstance(msg, t.Generate):
                    self._accept_remote(msg)
                elif isinstance(msg, t.Cancel):
                    self._cancel(msg.request_id, msg.reason)
                elif isinstance(msg, t.Control) and msg.op == rc.RingBroken.OP:
                    self._heard_broken(msg, tell=True)
                elif isinstance(msg, t.Control) and msg.op in rc.OPS:
                    self._control(msg)
        except ChannelError as exc:
            self._break(exc.broken())

    def _control(self, frame: t.Control) -> None:
        """A `free` come back round the ring, or a member's `stage_error`."""
        try:
            msg = rc.parse(frame)
        except rc.RingMessageError as exc:
            log.warning("ring_control_ignored", op=frame.op, reason=str(exc))
            return
        if isinstance(msg, rc.Free):
            self._hop_reports(msg.hops)
        elif isinstance(msg, rc.StageFailed):
            for rid in msg.request_ids:
                self._fail_request(rid, "internal", msg.message)

    async def _returned(self, frame: t.Hidden) -> None:
        step = Step(
            bool(frame.flags & t.Flag.PREFILL),
            tuple(Entry(e.request_id, e.position, e.n_tokens) for e in frame.entries),
            bool(frame.flags & t.Flag.LAST_CHUNK),
        )
        if step.prefill:
            for rid in dict.fromkeys(e.request_id for e in frame.entries):
                if rid in self._reqs:
                    self._reqs[rid].prefill_us.append(frame.timings_us)
        rids = [r for r in self.schedule.returned(step) if r in self._reqs]
        if rids and self.draft is not None:
            await self._verified(frame, step, rids)
        elif rids:
            nxt = self.schedule.continuation(step)  # run on the model thread right after sampling
            if nxt is not None and {e.request_id for e in nxt.entries} != set(rids):
                nxt = None
            if not step.prefill:
                for rid in rids:
                    _landed(self._reqs[rid])
            samplers = [self._reqs[rid].sampler for rid in rids]
            hopmarks.mark("l_submit", frame.entries)
            try:
                turn = await self.model.run(
                    compute.head_turn,
                    self.stage,
                    frame,
                    rids,
                    samplers,
                    None if nxt is None else _wire_entries(nxt),
                )
            except StageError as exc:
                self._fail_step(step, "internal", str(exc))
                return
            if nxt is not None and turn.ahead is not None:
                self._ahead = (nxt, turn.ahead)
            timings = (frame.timings_us[0] + turn.logits_us, *frame.timings_us[1:])
            now = time.perf_counter()
            for rid, token, reason in zip(rids, turn.tokens, turn.reasons, strict=True):
                if (req := self._reqs.get(rid)) is not None:  # (cancelled meanwhile: nothing to answer)
                    self._sampled(req, token, reason, step.prefill, timings, turn, now, _alone(frame))
        if self.next is None:  # a ring of one: _enter called us, the pump goes on
            self._wake.set()
        else:
            await self._advance()

    async def _verified(self, frame: t.Hidden, step: Step, rids: list[int]) -> None:
        """A step back at a head that drafts: verify what each request fed, answer what it kept,
        set its next draft (a prefill's last chunk verifies nothing and drafts the first)."""
        assert self.draft is not None
        reqs = [self._reqs[rid] for rid in rids]
        landed = [None if step.prefill else _landed(r) for r in reqs]
        fed = [() if f is None else f.draft for f in landed]
        # what the step ahead of each (if any) assumes it gives: its whole draft, then the guess
        expect = [
            None if f is None or not r.flights else (*f.draft, r.flights[0].first)
            for r, f in zip(reqs, landed, strict=True)
        ]
        drafting = [self._drafting(r, d, x) for r, d, x in zip(reqs, fed, expect, strict=True)]
        nxt_step = self.schedule.continuation(step)  # sent at once where no draft changes it
        if nxt_step is not None and {e.request_id for e in nxt_step.entries} != set(rids):
            nxt_step = None
        hopmarks.mark("l_submit", frame.entries)
        try:
            turn = await self.model.run(
                compute.verify_turn,
                self.stage,
                frame,
                rids,
                [r.sampler for r in reqs],
                drafting,
                self.draft,
                self._margin(),
                None if nxt_step is None else _wire_entries(nxt_step),
            )
        except StageError as exc:
            self._fail_step(step, "internal", str(exc))
            return
        if nxt_step is not None and turn.ahead is not None:
            self._ahead = (nxt_step, turn.ahead)
        timings = (frame.timings_us[0] + turn.logits_us, *frame.timings_us[1:])
        now = time.perf_counter()
        made = zip(turn.drafts, turn.draft_s, expect, strict=True)
        for req, d, verdict, (nxt, draft_s, x) in zip(reqs, fed, turn.verdicts, made, strict=True):
            if self._reqs.get(req.rid) is not req:  # cancelled meanwhile: nothing to answer
                continue
            if x is not None and not holds(verdict, x):  # the steps ahead assumed otherwise: void
                self.voided_ahead += self.schedule.void_ahead(req.rid)
                self.voided_rows += sum(1 + len(f.draft) for f in req.flights)
                req.flights.clear()
            if not step.prefill:
                circuit = turn.sampled_at - req.sent_at + (timings[0] - turn.logits_us) / 1e6
                req.draft_stats = observe(self.draft, req.draft_stats, len(d), verdict.accepted, circuit)
                req.drafted, req.accepted = req.drafted + len(d), req.accepted + verdict.accepted
            req.draft_stats = observe_drafting(self.draft, req.draft_stats, len(nxt), draft_s)
            req.draft = nxt
            took = (verdict.tokens, verdict.reason, step.prefill, timings)
            drafts = (len(d), verdict.accepted)
            self._took(req, *took, turn.logits_us, turn.sampled_at, now, drafts, _alone(frame))

    def _drafting(
        self, req: _Req, fed: tuple[int, ...], expect: tuple[int, ...] | None = None
    ) -> compute.Drafting:
        position = self.schedule.next_position(req.rid)  # where this step's last token was fed
        room = min(req.max_tokens - req.generated - 1, self.context - 2 - position)
        history = [*req.prompt, *req.tokens]
        proposer, catch_up = self._draft_model_calls(req.rid)
        return compute.Drafting(fed, history, req.draft_stats, room, proposer, catch_up, expect)

    def _draft_model_calls(self, rid: int) -> tuple[Proposer | None, Callable[[Sequence[int]], None] | None]:
        """The draft model's `propose` and `catch_up` for request `rid`; None, None for prompt lookup."""
        if self.drafter is None:
            return None, None
        return functools.partial(self.drafter.propose, rid), functools.partial(self.drafter.catch_up, rid)

    def _margin(self) -> float:
        """Greedy rows within this of a tie are sampled alone: 0 where a step's rows have the bits
        of one-row steps (the CPU kernels, `Stage.batch_rows`), else TIE_MARGIN."""
        if self.tie_margin is not None:
            return self.tie_margin
        return 0.0 if self.stage.batch_rows is not None else TIE_MARGIN

    def _sampled(
        self,
        req: _Req,
        token: int,
        reason: StopReason | None,
        prefill: bool,
        timings: tuple[int, ...],
        turn: compute.HeadTurn,
        now: float,
        alone: bool = False,
    ) -> None:
        """`token` (ended its request for `reason`, if any) sampled in `turn` on the model thread,
        which alone touches the request's sampler."""
        at = (turn.logits_us, turn.sampled_at, now)
        self._took(req, (token,), reason, prefill, timings, *at, (0, 0), alone)

    def _took(
        self,
        req: _Req,
        tokens: tuple[int, ...],
        reason: StopReason | None,
        prefill: bool,
        timings: tuple[int, ...],
        logits_us: int,
        sampled_at: float,
        now: float,
        drafts: tuple[int, int] = (0, 0),
        alone: bool = False,
    ) -> None:
        """`tokens` (the last ended its request for `reason`, if any) taken from one step, sampled
        on the model thread at `sampled_at`; () where a verification step kept none. `drafts`:
        the drafted tokens the step verified and those kept; `alone`: the step carried this
        request only (its stages' compute then prices its rows)."""
        if not prefill:
            req.circuits += 1
            self.counts = self.counts.add(*drafts, sum(timings) / 1e6 if alone else None)
            metrics.observe_circuit(len(tokens), *drafts)
            # from the head's blocks starting (their compute before the output left) to the token
            # sampled: every stage, the logits and the hops, as the plan's circuit
            head_blocks_s = (timings[0] - logits_us) / 1e6
            circuit = sampled_at - req.sent_at + head_blocks_s
            req.circuit_s.append(circuit)
            req.stage_us.append(timings)
            req.transit_ms.append((circuit * 1e6 - sum(timings)) / 1e3)
            self.tally.add(req.rid, timings[0], prefill=False)
        done = self.schedule.sampled(req.rid, reason is not None, len(tokens))
        if not done:  # a draft never asks for more tokens than the request has left
            req.draft = req.draft[: max(0, req.max_tokens - req.generated - len(tokens) - 1)]
            self.schedule.set_draft(req.rid, len(req.draft))
        if not tokens:
            return
        req.generated += len(tokens)
        metrics.observe_tokens(len(tokens))
        req.last_token = tokens[-1]
        req.tokens.extend(tokens)
        if self._first is not None and not self._first.done():
            self._first.set_result(time.monotonic())
        first = req.first_at is None
        if first:  # observed as the token comes, not when the request ends
            admitted = req.admitted_at or req.queued_at
            metrics.observe_first_token(admitted - req.queued_at, now - admitted, len(req.prompt))
        elif req.last_at is not None:  # tokens of one step share the interval since the last
            for _ in tokens:
                metrics.observe_token_interval((now - req.last_at) / len(tokens))
        req.first_at, req.last_at = req.first_at or now, now
        emitted = tokens[:-1] if reason == "stop" else tokens
        prefill_s = now - (req.admitted_at or now) if first else None
        finish = (reason or "length") if done else None
        drafted, accepted = drafts[0], min(drafts[1], len(emitted))
        event = TokenEvent(emitted, finish, None, prefill_s, drafted, accepted)
        self._answer(req, event)
        if done:
            req.finish = finish or "stop"
            self._reqs.pop(req.rid, None)
            self.last_request = (req.circuits, req.drafted, req.accepted)
            self._record(req)

    # -- answers ---------------------------------------------------------------------------------------

    def _answer(self, req: _Req, item: TokenEvent | GenerationError) -> None:
        """To whoever asked, in order, once the current loop turn is done: a frame that this turn
        hands to the next member leaves first, where the caller's task (a local request) or the
        Tokens message to the member that forwarded it would otherwise go before the frame."""
        if req.generation is not None:
            deliver = functools.partial(req.generation.push, item)
        elif self.next is not None:  # best effort for an error: the way to the member may be what broke
            deliver = functools.partial(self._outbox.put_nowait, _answer_message(req.rid, item))
        else:
            return
        asyncio.get_running_loop().call_soon(deliver)

    def _report_queue(self) -> None:
        """Tell waiting requests their new positions, at most every QUEUE_REPORT_S: each cancel
        or admission moves the whole queue, and a forwarded request's update is a message around
        the ring (400 waiting clients leaving at once were 75 000 messages: the ring broke)."""
        if self._queue_report is None:
            loop = asyncio.get_running_loop()
            self._queue_report = loop.call_later(QUEUE_REPORT_S, self._send_queue_positions)

    def _send_queue_positions(self) -> None:
        self._queue_report = None
        positions = self.schedule.queue_positions()
        for rid in [r for r in self._told if r not in positions]:
            del self._told[rid]
        for rid, pos in positions.items():
            if rid in self._reqs and self._told.get(rid) != pos:  # only a position that changed
                self._told[rid] = pos
                self._answer(self._reqs[rid], TokenEvent(queue_position=pos))

    def _fail_request(self, rid: int, code: str, message: str) -> None:
        req = self._reqs.pop(rid, None)
        if req is None:
            return
        self._answer(req, GenerationError(code, message))
        self._end(req, "error")
        self._wake.set()

    def _fail_step(self, step: Step, code: str, message: str) -> None:
        for e in step.entries:
            self._fail_request(e.request_id, code, message)

    def _fail_all(self, code: str, message: str) -> None:
        for rid in list(self._reqs):
            self._fail_request(rid, code, message)
        for rid in list(self._ending):  # no free will come round: record what is known
            self._record(self._ending.pop(rid))
            self.schedule.lost(rid)  # ... and it leaves /session's "active"
        self._flush_pending()

    def _in_flight(self) -> int:
        return len(self._reqs)

    def _fail_held(self, code: str, message: str) -> None:
        self._fail_all(code, message)

    def _hold(self) -> None:
        if self._queue_report is not None:
            self._queue_report.cancel()
            self._queue_report = None

    # -- traces ----------------------------------------------------------------------------------------

    def _record(self, req: _Req) -> None:
        """The head's own stage record now; the request record once the hop reports are back."""
        own = self.tally.finish(req.rid)
        if own is not None:
            if self.traces is not None:
                self.traces.write(own)
            metrics.observe_stage(own)
        if req.first_at is None:  # no token: nothing to time, only its end to count
            metrics.observe_no_token(req.finish)
            return
        pending = _Pending(req, own)
        if self.next is None:
            self._write(pending)
        else:
            self._pending[req.rid] = pending

    def _hop_reports(self, reports: Sequence[dict[str, Any]]) -> None:
        """A `free` notice came back: every member's hops for those requests; write their records."""
        done: set[int] = set()
        for d in reports:
            try:
                rid, member, hop_in, hop_out = read_hop_report(d)
            except ValueError as exc:
                log.warning("hop_report_ignored", reason=str(exc))
                continue
            if rid in self._pending:
                self._pending[rid].reports[member] = (hop_in, hop_out)
                done.add(rid)
        for rid in done:
            self._write(self._pending.pop(rid))

    def _flush_pending(self) -> None:
        for rid in list(self._pending):
            self._write(self._pending.pop(rid))

    def _write(self, pending: _Pending) -> None:
        rec = request_record(self.info, pending.req, ring_hops(self.info, pending), self.asked_by)
        if self.traces is not None:
            self.traces.write(rec)
        metrics.observe_request(rec)


def _landed(req: _Req) -> _Flight | None:
    """The oldest valid step of `req` came back: taken off its flights (its circuit is timed from
    when it left)."""
    if not req.flights:
        return None
    flight = req.flights.popleft()
    req.sent_at = flight.sent_at
    return flight


def _alone(frame: t.Hidden) -> bool:
    return len(frame.entries) == 1


def _answer_message(rid: int, item: TokenEvent | GenerationError) -> t.Message:
    if isinstance(item, GenerationError):
        return t.Error(rid, item.code, item.message)
    return t.Tokens(
        rid, item.tokens, item.finish, item.queue_position, item.prefill_s, item.drafted, item.accepted
    )


def _wire_entries(step: Step) -> tuple[t.Entry, ...]:
    return tuple(t.Entry(e.request_id, e.position, e.n_tokens) for e in step.entries)


@dataclass
class _Pending:
    req: _Req
    own: StageRecord | None  # the head's stage record (its hops)
    reports: dict[str, tuple[HopTrace | None, HopTrace | None]] = field(default_factory=dict)


def ring_hops(info: RingInfo, p: _Pending) -> tuple[HopTrace, ...]:
    """Every ring edge as counted by its sender (the receiver's count where the sender's is missing)."""
    hops = dict(p.reports)
    if p.own is not None:
        hops[info.order[0]] = (p.own.hop_in, p.own.hop_out)
    n, out = len(info.order), []
    for i in range(n if n > 1 else 0):
        a, b = info.order[i], info.order[(i + 1) % n]
        sent, received = hops.get(a, (None, None))[1], hops.get(b, (None, None))[0]
        edge = f"{a}->{b}"
        unknown = HopTrace(a, b, info.edges.get(edge, "local"), 0, 0, None, info.edge_rtt_ms.get(edge))
        out.append(sent or received or unknown)
    return tuple(out)


def request_record(
    info: RingInfo, req: _Req, hops: tuple[HopTrace, ...], asked_by: Mapping[int, str] | None = None
) -> RequestRecord:
    """`asked_by`: member names by origin tag (None: by first ring index)."""
    asked_by = dict(enumerate(info.order)) if asked_by is None else asked_by
    sent = {h.src: h.bytes for h in hops}
    stages = []
    for i, m in enumerate(info.order):
        samples = [s[i] / 1e3 for s in req.stage_us if len(s) > i]
        chunks = [s[i] / 1e3 for s in req.prefill_us if len(s) > i]
        stages.append(
            StageTrace(
                member=m,
                index=i,
                blocks=info.blocks[m],
                head=i == 0,
                predicted_ms=info.predicted_ms.get(m, 0.0),
                measured_ms=statistics.median(samples) if samples else 0.0,
                steps=len(samples),
                bytes_out=sent.get(m, 0),
                prefill_ms=sum(chunks),
                prefill_chunks=len(chunks),
            )
        )
    first, last = req.first_at or 0.0, req.last_at or 0.0
    return RequestRecord(
        session=info.session,
        request_id=req.rid,
        member=req.asker or asked_by.get(origin_of(req.rid), "?"),
        division=info.division,
        prompt_tokens=len(req.prompt),
        completion_tokens=req.generated,
        queue_s=(req.admitted_at or req.queued_at) - req.queued_at,
        prefill_s=first - (req.admitted_at or first),
        decode_s=last - first,
        circuit_ms=statistics.median(req.circuit_s) * 1e3 if req.circuit_s else 0.0,
        stages=tuple(stages),
        hops=hops,
        finish=req.finish,
        transit_ms=statistics.median(req.transit_ms) if req.transit_ms else 0.0,
        epoch=info.epoch,
    )
