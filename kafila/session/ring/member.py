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
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kafila.api.service import GenerationError, Sampling, TokenEvent
from kafila.engine.draft import DraftPolicy
from kafila.engine.stage import Stage, StageError
from kafila.obs import hopmarks, metrics
from kafila.obs.log import get_logger
from kafila.obs.trace import TraceLog
from kafila.proto import ring as rc
from kafila.proto import tensor as t
from kafila.proto.ring import Cause, RingBroken
from kafila.session.channel import Channel, ChannelError
from kafila.session.ring import compute
from kafila.session.ring.generation import QueueGeneration, cancel_tasks, guarded
from kafila.session.ring.info import RingInfo
from kafila.session.ring.origins import RequestIds, origin_of
from kafila.session.ring.role import RoleBase
from kafila.session.ring.stagetrace import StageTally, hop_report

log = get_logger("kafila.session.ring.member")


class RingMember(RoleBase):
    def __init__(
        self,
        index: int,
        stage: Stage,
        model: compute.ModelThread,
        info: RingInfo,
        next_ch: Channel,
        prev_ch: Channel,
        traces: TraceLog | None = None,
        origin: int | None = None,  # its requests' origin tag, the host's (None: its ring index)
    ) -> None:
        super().__init__(info.order[index], next_ch, prev_ch)
        self.next: Channel = next_ch
        self.prev: Channel = prev_ch
        self.index, self.stage, self.model, self.info = index, stage, model, info
        self.traces = traces  # this member's own records (its stage, its hops); None: metrics only
        self.tally = StageTally(info, index, next_ch, prev_ch)
        self._arrived: dict[int, float] = {}  # id of a waiting frame -> when it arrived
        self.ids = RequestIds(index if origin is None else origin)  # kept across epochs
        self.origin = self.ids.origin
        self._mine: dict[int, QueueGeneration] = {}
        self._asked: dict[int, t.Generate] = {}  # what each of them asked: carried to a new head
        self._acks: dict[int, asyncio.Future[None]] = {}  # forwarded, the head's first answer awaited
        self._forwarded: dict[int, t.Generate] = {}  # ... and the message, sent again after a re-plan
        self._late: list[t.Cancel] = []  # cancels while re-planning, sent once the ring serves again
        self._delivered: dict[int, list[int]] = {}  # tokens its clients have had (a resync, a new head)
        self._work: list[t.Hidden | rc.Free] = []
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.draft: DraftPolicy | None = None  # how it drafts should it become the head (promote)

    # -- GenerationService -----------------------------------------------------------------------------

    @property
    def context(self) -> int:
        return self.stage.context

    async def submit(self, prompt: Sequence[int], sampling: Sampling, asker: str = "") -> QueueGeneration:
        """Forward a request to the head; `asker`: the member whose client asked, where it is not
        this one (a spare's request the host relays), for the head's records."""
        self.refuse_new()
        rid = self.ids.next()
        gen = QueueGeneration(rid, self._cancel)
        self._mine[rid] = gen
        msg = self._forwarded[rid] = self._asked[rid] = replace(sampling.forwarded(rid, prompt), asker=asker)
        ack = self._acks[rid] = asyncio.get_running_loop().create_future()
        self._outbox.put_nowait(msg)
        log.info(
            "request_forwarded", request_id=rid, head=self.info.order[0], prompt_tokens=len(prompt),
            **({"asker": asker} if asker else {}),
        )  # fmt: skip
        try:  # admitted, queued or refused: a refusal (a full queue) is raised here, before any answer
            await ack
        except asyncio.CancelledError:
            gen.cancel("client gone")
            raise
        finally:
            self._acks.pop(rid, None)
            self._forwarded.pop(rid, None)
        return gen

    def describe(self) -> dict[str, Any]:
        return self.document() | {"me": self.name}

    def _cancel(self, rid: int, reason: str) -> None:
        self._forget(rid)
        if self.state == "replanning":
            self._late.append(t.Cancel(rid, reason))
        elif self.broken is None:
            self._outbox.put_nowait(t.Cancel(rid, reason))

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> RingMember:
        loops = [self._receive, self._compute, self._send_out, self._watch_stall]
        if self.next is not self.prev:
            loops.append(self._watch_next)
        self._tasks = [guarded(c, self.name, self._internal_error) for c in loops]
        return self

    async def stop(self) -> None:
        await cancel_tasks(self._tasks)

    async def pause(self) -> None:
        """Stop this epoch's loops; its clients' requests stay (the head carries them on)."""
        await cancel_tasks(self._tasks)

    def resume(
        self, epoch: int, index: int, stage: Stage, info: RingInfo, next_ch: Channel, prev_ch: Channel
    ) -> None:
        """Serve epoch `epoch` as ring member `index` on `stage` and these channels. Requests not
        yet answered by the head are sent again (the head ignores one it carried on); where the
        head moved (its member was lost), every request of this member's clients is sent to the
        new head with the tokens they have had, which it prefills after the prompt and goes on from."""
        moved = info.order[0] != self.info.order[0]
        self._retire(next_ch, prev_ch)
        self.epoch, self.index, self.stage, self.info = epoch, index, stage, info
        self.next, self.prev = next_ch, prev_ch
        self.tally = StageTally(info, index, next_ch, prev_ch)
        self._work.clear()
        self._arrived.clear()
        self._outbox = asyncio.Queue()
        for msg in self.carried() if moved else self._forwarded.values():
            self._outbox.put_nowait(msg)
        if moved:
            log.info("requests_carried", epoch=epoch, head=info.order[0], count=len(self._mine))
        for cancel in self._late:
            self._outbox.put_nowait(cancel)
        self._late.clear()
        self.broken = None
        self.start()

    def carried(self) -> list[t.Generate]:
        """Every request of this member's clients as a new head takes it: what it asked, marked
        carried, with the tokens its client has had."""
        return [
            replace(self._asked[rid], carried=True, generated=tuple(self._delivered.get(rid, ())))
            for rid in self._mine
            if rid in self._asked
        ]

    def handed_over(self) -> list[tuple[t.Generate, QueueGeneration]]:
        """This member becomes the head: its clients' requests (as `carried` gives them) and their
        streams, which it serves from now on; unanswered submits go on (the head answers the streams)."""
        held = [(msg, self._mine[msg.request_id]) for msg in self.carried()]
        for ack in self._acks.values():
            if not ack.done():
                ack.set_result(None)
        self._mine.clear()
        self._asked.clear()
        self._delivered.clear()
        return held

    def _forget(self, rid: int) -> None:
        self._mine.pop(rid, None)
        self._asked.pop(rid, None)
        self._delivered.pop(rid, None)

    # -- loops -----------------------------------------------------------------------------------------

    async def _receive(self) -> None:
        try:
            while True:
                self._dispatch(await self.prev.recv())
        except ChannelError as exc:
            self._break(exc.broken())

    def _dispatch(self, msg: t.Message) -> None:
        if isinstance(msg, t.Control) and msg.op == rc.RingBroken.OP:
            self._heard_broken(msg, tell=False)
            self._outbox.put_nowait(msg)  # on round the ring as it came
        elif isinstance(msg, t.Control) and msg.op == rc.Free.OP:
            try:
                self._work.append(rc.Free.parse(msg.body))
            except rc.RingMessageError as exc:
                self._break(RingBroken(self.prev.peer, Cause.ERROR, f"member {self.prev.peer}: {exc}"))
                return
            self._ready.set()
        elif isinstance(msg, t.Control) and msg.op == rc.Resync.OP:
            self._resync(msg)
        elif isinstance(msg, t.Hidden):
            self._work.append(msg)
            self._arrived[id(msg)] = time.perf_counter()
            self._ready.set()
        elif isinstance(msg, t.Tokens | t.Error) and origin_of(msg.request_id) == self.origin:
            self._deliver(msg)
        elif isinstance(msg, t.Tokens | t.Error | t.Generate | t.Cancel | t.Control):
            self._outbox.put_nowait(msg)  # on its way to the head, or back to another member

    def _resync(self, frame: t.Control) -> None:
        """The head's tokens of a request carried through a re-plan: pass on those not delivered."""
        try:
            msg = rc.Resync.parse(frame.body)
        except rc.RingMessageError as exc:
            log.warning("ring_control_ignored", op=frame.op, reason=str(exc))
            return
        if origin_of(msg.request_id) != self.origin:
            self._outbox.put_nowait(frame)  # on to the member it is for
            return
        have = len(self._delivered.get(msg.request_id, ()))
        self._deliver(t.Tokens(msg.request_id, msg.tokens[have:]))

    def _deliver(self, msg: t.Tokens | t.Error) -> None:
        gen = self._mine.get(msg.request_id)
        if gen is None:
            return
        ack = self._acks.pop(msg.request_id, None)
        if ack is not None and not ack.done():
            if isinstance(msg, t.Error):  # refused by the head: submit raises it
                self._forget(msg.request_id)
                ack.set_exception(GenerationError(msg.code, msg.message))
                return
            ack.set_result(None)
        if isinstance(msg, t.Error):
            gen.push(GenerationError(msg.code, msg.message))
        elif msg.tokens or msg.finish or msg.queue_position:  # not the bare "admitted"
            gen.push(
                TokenEvent(
                    msg.tokens, msg.finish, msg.queue_position, msg.prefill_s, msg.drafted, msg.accepted
                )
            )
            self._delivered.setdefault(msg.request_id, []).extend(msg.tokens)
        if gen.finished:
            self._forget(msg.request_id)

    async def _compute(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._work:
                batch = self._take_batch()
                if isinstance(batch, rc.Free):
                    ids = list(batch.request_ids)
                    await self.model.run(compute.close_slots, self.stage, ids)
                    self._outbox.put_nowait(rc.control(self._traced_free(batch)))
                else:
                    await self._run(batch)  # a StageError is answered per request; others: guarded

    def _take_batch(self) -> rc.Free | list[t.Hidden]:
        """The next `free`, a prefill frame alone, or the longest run of waiting decode frames whose
        requests are distinct, within the rows the engine computes independently of each other
        (`Stage.batch_rows`): a decode row batched with a prefill chunk, or rows past that, would
        take another kernel and come out in other bits than alone (a seeded answer changed when
        another prompt prefilled alongside). Prefill frames stay apart for the reason the head
        sends prompts as separate steps (kafila.session.ring.schedule): the next stage can start on one
        while this one computes the next."""
        first = self._work.pop(0)
        if isinstance(first, rc.Free):
            return first
        batch: list[t.Hidden] = [first]
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
            batch.append(nxt)
            self._work.pop(0)
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
            failed = rc.StageFailed(tuple(rids), f"member {self.name}: {exc}")
            self._outbox.put_nowait(rc.control(failed))  # to the head, which answers
            return
        wire = compute.wire_dtype(self.stage)
        for f, data, wait in zip(frames, datas, waited, strict=True):
            self.tally.computed(f, us, int(wait * 1e6))
            out = t.Hidden(f.step, wire, f.shape, f.entries, data, f.flags, (*f.timings_us, us))
            self._outbox.put_nowait(out)

    def _traced_free(self, free: rc.Free) -> rc.Free:
        """Record the freed requests here; the notice carries on with this member's hop figures."""
        reports = list(free.hops)
        for rid in free.request_ids:
            rec = self.tally.finish(rid)
            if rec is None:
                continue  # never reached this stage (cancelled while queued)
            if self.traces is not None:
                self.traces.write(rec)
            metrics.observe_stage(rec)
            reports.append(hop_report(rec))
        return rc.Free(free.request_ids, tuple(reports))

    def _in_flight(self) -> int:
        return len(self._mine)

    def _fail_held(self, code: str, message: str) -> None:
        """Fail this member's own requests (after a break, its notice went downstream to the head)."""
        for gen in list(self._mine.values()):
            gen.push(GenerationError(code, message))
        self._mine.clear()
        self._asked.clear()
        self._delivered.clear()
        for ack in self._acks.values():  # forwarded, not answered yet
            if not ack.done():
                ack.set_exception(GenerationError(code, message))
        self._acks.clear()
