"""A ring member that is not the head: runs its blocks on what arrives, forwards the rest.

From the previous member arrive hidden-state frames (run through this stage's blocks and passed
on), `free` notices (drop those requests' KV caches, pass on), requests on their way to the head
(pass on) and answers on their way back to the member that asked (deliver here, or pass on).
Decode frames that are waiting when the model thread comes free run as one batch when they hold
distinct requests; prefill frames run one at a time, as the head sends them (kafila.session.ring.schedule:
separate steps overlap along the ring, a merged one does not). The member is also a
GenerationService: its API's requests travel the ring to the head.

What it measures (kafila.session.ring.stagetrace): per request, its stage's compute per decode step
and per prefill chunk, and the bytes its links counted. When a request's `free` passes, the member
writes its `StageRecord` (trace file, /traces, metrics) and adds its hop figures to the `free`, so
the head, which the notice reaches last, records the whole ring.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from kafila.api.service import GenerationError, Sampling, TokenEvent
from kafila.engine.stage import Stage, StageError
from kafila.obs import hopmarks, metrics
from kafila.obs.log import get_logger
from kafila.obs.trace import TraceLog
from kafila.proto import tensor as t
from kafila.session.channel import Channel, ChannelError, send_marked
from kafila.session.ring import compute
from kafila.session.ring.generation import QueueGeneration, RequestIds, cancel_tasks, guarded, origin_of
from kafila.session.ring.info import RingInfo
from kafila.session.ring.stagetrace import StageTally, hop_report

log = get_logger("kafila.session.ring.member")


class RingMember:
    def __init__(
        self,
        index: int,
        stage: Stage,
        model: compute.ModelThread,
        info: RingInfo,
        next_ch: Channel,
        prev_ch: Channel,
        traces: TraceLog | None = None,
    ) -> None:
        self.index, self.stage, self.model, self.info = index, stage, model, info
        self.name = info.order[index]
        self.next, self.prev = next_ch, prev_ch
        self.traces = traces  # this member's own records (its stage, its hops); None: metrics only
        self.tally = StageTally(info, index, next_ch, prev_ch)
        self._arrived: dict[int, float] = {}  # id of a waiting frame -> when it arrived
        self.ids = RequestIds(index)
        self.broken: str | None = None
        self.on_broken: Callable[[str], None] | None = None  # told once, e.g. the person at the terminal
        self.ending = False  # the host ended the session on purpose: its ring breaking is no fault
        self.on_ended: Callable[[], None] | None = None  # told when a "broken" says the host ended it
        self._mine: dict[int, QueueGeneration] = {}
        self._acks: dict[int, asyncio.Future[None]] = {}  # forwarded, the head's first answer awaited
        self._work: list[t.Hidden | t.Control] = []
        self._ready = asyncio.Event()
        self._outbox: asyncio.Queue[t.Message] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    # -- GenerationService -----------------------------------------------------------------------------

    @property
    def context(self) -> int:
        return self.stage.context

    async def submit(self, prompt: Sequence[int], sampling: Sampling) -> QueueGeneration:
        if self.broken is not None:
            raise GenerationError("member_lost", self.broken)
        rid = self.ids.next()
        gen = QueueGeneration(rid, self._cancel)
        self._mine[rid] = gen
        msg = sampling.forwarded(rid, prompt)
        ack = self._acks[rid] = asyncio.get_running_loop().create_future()
        self._outbox.put_nowait(msg)
        log.info("request_forwarded", request_id=rid, head=self.info.order[0], prompt_tokens=len(prompt))
        try:  # admitted, queued or refused: a refusal (a full queue) is raised here, before any answer
            await ack
        except asyncio.CancelledError:
            gen.cancel("client gone")
            raise
        finally:
            self._acks.pop(rid, None)
        return gen

    def describe(self) -> dict[str, Any]:
        return self.info.document("serving", self.broken) | {"me": self.name}

    def _cancel(self, rid: int, reason: str) -> None:
        self._mine.pop(rid, None)
        if self.broken is None:
            self._outbox.put_nowait(t.Cancel(rid, reason))

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> RingMember:
        loops = [self._receive, self._compute, self._send_out]
        if self.next is not self.prev:
            loops.append(self._watch_next)
        self._tasks = [guarded(c, self.name, self._break) for c in loops]
        return self

    async def stop(self) -> None:
        await cancel_tasks(self._tasks)

    # -- loops -----------------------------------------------------------------------------------------

    async def _receive(self) -> None:
        try:
            while True:
                self._dispatch(await self.prev.recv())
        except ChannelError as exc:
            self._break(str(exc))

    def _dispatch(self, msg: t.Message) -> None:
        if isinstance(msg, t.Control) and msg.op == "broken":
            if msg.body.get("ended") is True and self.on_ended is not None:
                self.on_ended()  # the host ended the session: its link's closing may come after this
            self._break(str(msg.body.get("reason")), tell=False)
            self._outbox.put_nowait(msg)
        elif isinstance(msg, t.Hidden) or (isinstance(msg, t.Control) and msg.op == "free"):
            self._work.append(msg)
            if isinstance(msg, t.Hidden):
                self._arrived[id(msg)] = time.perf_counter()
            self._ready.set()
        elif isinstance(msg, t.Tokens | t.Error) and origin_of(msg.request_id) == self.index:
            self._deliver(msg)
        elif isinstance(msg, t.Tokens | t.Error | t.Generate | t.Cancel | t.Control):
            self._outbox.put_nowait(msg)  # on its way to the head, or back to another member

    def _deliver(self, msg: t.Tokens | t.Error) -> None:
        gen = self._mine.get(msg.request_id)
        if gen is None:
            return
        ack = self._acks.pop(msg.request_id, None)
        if ack is not None and not ack.done():
            if isinstance(msg, t.Error):  # refused by the head: submit raises it
                self._mine.pop(msg.request_id, None)
                ack.set_exception(GenerationError(msg.code, msg.message))
                return
            ack.set_result(None)
        if isinstance(msg, t.Error):
            gen.push(GenerationError(msg.code, msg.message))
        elif msg.tokens or msg.finish or msg.queue_position:  # not the bare "admitted"
            gen.push(TokenEvent(msg.tokens, msg.finish, msg.queue_position, msg.prefill_s))
        if gen.finished:
            self._mine.pop(msg.request_id, None)

    async def _compute(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._work:
                batch = self._take_batch()
                if isinstance(batch, t.Control):
                    ids = [int(r) for r in batch.body.get("request_ids", [])]
                    await self.model.run(compute.close_slots, self.stage, ids)
                    self._outbox.put_nowait(self._traced_free(batch, ids))
                else:
                    await self._run(batch)  # a StageError is answered per request; others: guarded

    def _take_batch(self) -> t.Control | list[t.Hidden]:
        """The next `free`, a prefill frame alone, or the longest run of waiting decode frames whose
        requests are distinct, within the rows the engine computes independently of each other
        (`Stage.batch_rows`): a decode row batched with a prefill chunk, or rows past that, would
        take another kernel and come out in other bits than alone (a seeded answer changed when
        another prompt prefilled alongside). Prefill frames stay apart for the reason the head
        sends prompts as separate steps (kafila.session.ring.schedule): the next stage can start on one
        while this one computes the next."""
        if isinstance(self._work[0], t.Control):
            return self._work.pop(0)  # type: ignore[return-value]
        batch: list[t.Hidden] = [self._work.pop(0)]  # type: ignore[list-item]
        if batch[0].flags & t.Flag.PREFILL:
            return batch
        seen = {e.request_id for e in batch[0].entries}
        rows, limit = batch[0].shape[0], self.stage.batch_rows
        while self._work and isinstance(nxt := self._work[0], t.Hidden):
            rids = {e.request_id for e in nxt.entries}
            if rids & seen or nxt.flags & t.Flag.PREFILL:
                break
            if limit is not None and rows + nxt.shape[0] > limit:
                break
            seen |= rids
            rows += nxt.shape[0]
            batch.append(self._work.pop(0))  # type: ignore[arg-type]
        return batch

    async def _run(self, frames: list[t.Hidden]) -> None:
        started = time.perf_counter()
        waited = [started - self._arrived.pop(id(f), started) for f in frames]  # behind earlier work
        try:
            hopmarks.mark("submit", frames[0].entries)
            datas, us = await self.model.run(compute.stage_step, self.stage, frames)
            hopmarks.mark("back", frames[0].entries)
        except StageError as exc:
            rids = [e.request_id for f in frames for e in f.entries]
            body = {"request_ids": rids, "message": f"member {self.name}: {exc}"}
            self._outbox.put_nowait(t.Control("stage_error", body))  # to the head, which answers
            return
        wire = compute.wire_dtype(self.stage)
        for f, data, wait in zip(frames, datas, waited, strict=True):
            self.tally.computed(f, us, int(wait * 1e6))
            out = t.Hidden(f.step, wire, f.shape, f.entries, data, f.flags, (*f.timings_us, us))
            self._outbox.put_nowait(out)

    def _traced_free(self, free: t.Control, ids: list[int]) -> t.Control:
        """Record the freed requests here; the notice carries on with this member's hop figures."""
        before = free.body.get("hops")
        reports = list(before) if isinstance(before, list) else []
        for rid in ids:
            rec = self.tally.finish(rid)
            if rec is None:
                continue  # never reached this stage (cancelled while queued)
            if self.traces is not None:
                self.traces.write(rec)
            metrics.observe_stage(rec)
            reports.append(hop_report(rec))
        return t.Control("free", free.body | {"hops": reports})

    async def _watch_next(self) -> None:
        """The next member sends nothing on this link but its beats: hearing them (or not) tells
        whether it is alive, so a dead successor is noticed here too."""
        try:
            while True:
                await self.next.recv()
        except ChannelError as exc:
            self._break(str(exc))

    async def _send_out(self) -> None:
        try:
            while True:
                await send_marked(self.next, await self._outbox.get(), self.prev)
        except ChannelError as exc:
            self._break(f"member {self.next.peer}: {exc}")

    def _break(self, reason: str, tell: bool = True) -> None:
        """Fail this member's requests; tell the members downstream (and so the head) why."""
        if self.broken is None:
            self.broken = (
                reason if reason.startswith("the ring is broken") else f"the ring is broken: {reason}"
            )
            level = log.info if self.ending else log.error
            level("ring_broken", member=self.name, reason=reason, waiting=len(self._mine), ending=self.ending)
            if self.on_broken is not None:
                self.on_broken(self.broken)
            if tell:
                self._outbox.put_nowait(t.Control("broken", {"reason": self.broken, "ended": self.ending}))
        for gen in list(self._mine.values()):
            gen.push(GenerationError("member_lost", self.broken))
        self._mine.clear()
        for ack in self._acks.values():  # forwarded, not answered yet
            if not ack.done():
                ack.set_exception(GenerationError("member_lost", self.broken))
        self._acks.clear()
