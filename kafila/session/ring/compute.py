"""What a member's model thread does: stage steps on wire bytes (runs only on that thread).

`ModelThread` is the one thread that owns a member's Stage; the asyncio shell submits functions to
it and awaits their results. The functions below turn tensor frames into stage steps and back:
hidden states cross the thread boundary only as bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kafila.engine.draft import DraftPolicy, DraftStats, Proposer, propose, propose_ahead
from kafila.engine.draft_model import DraftModel
from kafila.engine.pace import Mark, Pace
from kafila.engine.sampler import Sampler, StopReason
from kafila.engine.speculative import Verdict, holds, verify
from kafila.engine.stage import Entry as StageEntry
from kafila.engine.stage import Stage, StageError
from kafila.obs import hopmarks
from kafila.obs.log import get_logger
from kafila.proto import tensor as t
from kafila.session.progress import MODEL_THREAD

log = get_logger("kafila.session.ring.compute")

T = TypeVar("T")
WIRE = {"F32": t.DType.F32, "F16": t.DType.F16, "BF16": t.DType.BF16}


class ModelThread:
    """The one thread that runs every call on the member's Stage, in order.

    A lean executor: calls wait in a SimpleQueue and each result comes back to the caller's loop
    with one `call_soon_threadsafe`. (`run_in_executor` adds a concurrent Future, its lock and a
    chained callback: about 40 us more per call on this machine's VM, four calls per token at the
    head.) A call whose awaiting task was cancelled still runs; its result is dropped.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._main, name=f"{MODEL_THREAD}{name}", daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closed:
            raise RuntimeError("the model thread is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((loop, future, fn, args))
        return await future

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue a call nobody awaits (work for the time the thread would wait): an error it
        raises is logged; dropped when the thread closes."""
        if not self._closed:
            self._calls.put((None, None, fn, args))

    def close(self) -> None:
        """Calls still waiting are dropped (their callers see CancelledError); a running one ends."""
        self._closed = True
        self._calls.put(None)

    def _main(self) -> None:
        while (call := self._calls.get()) is not None:
            loop, future, fn, args = call
            if loop is None or future is None:  # posted: nobody awaits it
                if not self._closed and (error := _outcome(fn, args)[1]) is not None:
                    log.warning(
                        "model_thread_call_failed", call=getattr(fn, "__name__", str(fn)), error=str(error)
                    )
                continue
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
                if self._closed:  # dropped by close()
                    loop.call_soon_threadsafe(future.cancel)
                else:
                    loop.call_soon_threadsafe(_settle, future, *_outcome(fn, args))


def _outcome(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, BaseException | None]:
    try:
        return fn(*args), None
    except BaseException as exc:  # handed to the caller, as an executor does
        return None, exc


# (loop, future, fn, args); loop and future None for a posted call
_Call = tuple[
    asyncio.AbstractEventLoop | None, "asyncio.Future[Any] | None", Callable[..., Any], tuple[Any, ...]
]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def open_new(stage: Stage, entries: Sequence[t.Entry]) -> None:
    """Give a KV slot to every request seen here for the first time (its position 0)."""
    for e in entries:
        if e.position == 0 and e.request_id not in stage.open_requests:
            stage.open(e.request_id)


def head_step(
    stage: Stage, entries: Sequence[t.Entry], tokens: Sequence[Sequence[int]], decode: bool = False
) -> tuple[bytes, int, int]:
    """Embed each entry's tokens and run the head's blocks: (wire bytes [N, H], rows, microseconds).
    `decode`: a decode step, whose entries may hold drafted tokens (each row a decode row)."""
    hopmarks.mark("start", entries)
    start = Pace.mark()
    open_new(stage, entries)
    ids = [tok for toks in tokens for tok in toks]
    hidden = stage.embed(ids)  # [N, H]
    out = stage.step(hidden, [StageEntry(e.request_id, e.position, e.n_tokens) for e in entries], decode)
    data = stage.to_bytes(out)
    us = _us(stage, start)
    hopmarks.mark("end", entries)
    return data, len(ids), us


def stage_step(stage: Stage, frames: Sequence[t.Hidden]) -> tuple[list[bytes], int]:
    """Several frames through this stage's blocks as one batch: each frame's output bytes, microseconds.
    The frames hold distinct requests (the caller checks)."""
    hopmarks.mark("start", frames[0].entries)
    start = Pace.mark()
    for f in frames:
        check_dtype(stage, f)
    entries = [e for f in frames for e in f.entries]
    open_new(stage, entries)
    parts = [stage.from_bytes(f.data, f.shape) for f in frames]  # each [n_f, H]
    hidden = stage.backend.concat(parts)  # [N, H]
    decode = not frames[0].flags & t.Flag.PREFILL  # (prefill frames run alone)
    out = stage.step(hidden, [StageEntry(e.request_id, e.position, e.n_tokens) for e in entries], decode)
    datas, at = [], 0
    for f in frames:
        rows = f.shape[0]
        datas.append(stage.to_bytes(out[at : at + rows]))
        at += rows
    us = _us(stage, start)
    hopmarks.mark("end", frames[0].entries)
    return datas, us


def head_logits(
    stage: Stage, frame: t.Hidden, rids: Sequence[int], every_row: bool = False
) -> tuple[np.ndarray, int]:
    """The last row of each named request's rows -> logits [B, V] (float32), microseconds;
    `every_row`: all of their rows, in the frame's order ([sum of their rows, V])."""
    hopmarks.mark("l_start", frame.entries)
    start = Pace.mark()
    check_dtype(stage, frame)
    hidden = stage.from_bytes(frame.data, frame.shape)  # [N, H]
    rows_of, at = {}, 0
    for e in frame.entries:
        rows_of[e.request_id] = range(at, at + e.n_tokens)
        at += e.n_tokens
    picked = [i for r in rids for i in (rows_of[r] if every_row else rows_of[r][-1:])]
    logits = stage.logits(hidden[picked])  # [B or rows, V]
    us = _us(stage, start)
    hopmarks.mark("l_end", frame.entries)
    return logits, us


@dataclass(frozen=True)
class HeadTurn:
    """A frame back at the head, on the model thread: one token per request, the logits' time, and
    the lane's next step when it could run at once."""

    tokens: list[int]
    reasons: list[StopReason | None]  # each token's: "stop" (EOS, a stop id), "length", or None
    logits_us: int
    sampled_at: float  # time.perf_counter() when the tokens were sampled
    ahead: tuple[bytes, int, int] | None  # `head_step` of the continuation: (wire bytes, rows, us)


def head_turn(
    stage: Stage,
    frame: t.Hidden,
    rids: Sequence[int],
    samplers: Sequence[Sampler],
    continuation: Sequence[t.Entry] | None,
) -> HeadTurn:
    """Logits of each named request's last row and its token from its sampler; then, when no token
    ends its request and `continuation` (Schedule.continuation: the lane's next step, the same
    requests one position on) is given, that step's embedding and head blocks at once: the step
    leaves without a trip through the event loop between sampling and computing it."""
    logits, us = head_logits(stage, frame, rids)  # [B, V]
    tokens = [sampler.sample(row) for sampler, row in zip(samplers, logits, strict=True)]
    reasons = [s.stop_reason(tok) for s, tok in zip(samplers, tokens, strict=True)]
    sampled_at = time.perf_counter()
    hopmarks.mark("sampled", frame.entries)
    ahead = None
    if continuation is not None and not any(reasons):
        token_of = dict(zip(rids, tokens, strict=True))
        hopmarks.mark("submit", continuation)
        with contextlib.suppress(StageError):  # the step is run again on its own and fails there by name
            ahead = head_step(stage, continuation, [[token_of[e.request_id]] for e in continuation], True)
    return HeadTurn(tokens, reasons, us, sampled_at, ahead)


def wire_dtype(stage: Stage) -> t.DType:
    """The dtype of the hidden states this stage sends (its compute dtype)."""
    return WIRE[stage.wire_dtype]


def check_dtype(stage: Stage, frame: t.Hidden) -> None:
    """A frame in another dtype than this stage computes in is refused by name: its bytes would
    be read as the wrong numbers. (Members take the session's dtype from the host's plan.)"""
    if frame.dtype is not wire_dtype(stage):
        raise StageError(
            f"stage blocks [{stage.blocks.start}, {stage.blocks.stop}) computes in {stage.wire_dtype} but "
            f"received hidden states in {frame.dtype.name}: the session's members disagree on the dtype"
        )


def close_slots(stage: Stage, rids: Sequence[int], drafter: DraftModel | None = None) -> None:
    """Free each request's KV slot on `stage` (and on the head's draft model)."""
    for rid in rids:
        stage.close(rid)
        if drafter is not None:
            drafter.close(rid)


def _us(stage: Stage, start: Mark) -> int:
    """Microseconds since `start`, after the stage's emulated pace has idled (see engine.pace)."""
    return int(stage.pace.finish(start) * 1e6)


@dataclass(frozen=True)
class Drafting:
    """What the head's model thread needs to verify a request's drafted tokens and draft its next:
    the tokens its step fed after its last one, its prompt and answer so far, its measurements,
    and the most tokens it may draft next (before this step's tokens are counted); `proposer`:
    its draft model's (kafila.engine.draft_model), None for prompt lookup."""

    fed: tuple[int, ...]
    history: Sequence[int]
    stats: DraftStats
    room: int
    proposer: Proposer | None = None
    catch_up: Callable[[Sequence[int]], None] | None = None  # the draft model's (DraftModel.catch_up)
    expect: tuple[int, ...] | None = None  # what a step sent ahead of this one assumes it gives


@dataclass(frozen=True)
class VerifyTurn:
    """A decode frame back at a head that drafts: each request's verdict and its next draft."""

    verdicts: list[Verdict]
    drafts: list[tuple[int, ...]]  # the next step's draft of each request (() where it ended)
    logits_us: int
    sampled_at: float
    ahead: tuple[bytes, int, int] | None = None  # `head_step` of the continuation, as HeadTurn's
    draft_s: tuple[float, ...] = ()  # seconds each request's next draft took to make


def verify_turn(
    stage: Stage,
    frame: t.Hidden,
    rids: Sequence[int],
    samplers: Sequence[Sampler],
    drafting: Sequence[Drafting],
    policy: DraftPolicy,
    tie_margin: float,
    continuation: Sequence[t.Entry] | None = None,
) -> VerifyTurn:
    """Logits of every row of each named request, the tokens `verify` keeps of what it fed, and
    the draft for its next step (kafila.engine.draft.propose, after the tokens kept; none where a
    step sent ahead holds, `Drafting.expect`: that one is its next). Where every
    request took one token, goes on and drafts nothing, `continuation` (one token each, as
    `head_turn`'s) runs at once: a request whose drafts find nothing loses no time to them."""
    decode = not frame.flags & t.Flag.PREFILL  # a prefill's last chunk: its last row only
    logits, us = head_logits(stage, frame, rids, every_row=decode)  # [rows, V]
    verdicts, at = [], 0
    for sampler, d in zip(samplers, drafting, strict=True):
        n = len(d.fed) + 1
        verdicts.append(verify(sampler, logits[at : at + n], d.fed, tie_margin))
        at += n
    sampled_at = time.perf_counter()
    hopmarks.mark("sampled", frame.entries)
    drafts: list[tuple[int, ...]] = []
    draft_s: list[float] = []
    for v, d in zip(verdicts, drafting, strict=True):
        room = d.room - len(v.tokens)
        history = [*d.history, *v.tokens]
        # a step sent ahead that holds is the request's next: nothing to draft now
        ahead_holds = d.expect is not None and holds(v, d.expect)
        drafting_next = v.reason is None and not v.tied and room >= 1 and not ahead_holds
        if drafting_next and d.catch_up is not None:
            d.catch_up(history)  # not the draft's time: a prompt's catch-up would price drafting out
        began = time.perf_counter()
        drafts.append(propose(policy, d.stats, history, room, d.proposer) if drafting_next else ())
        draft_s.append(time.perf_counter() - began)
    ahead = None
    plain = all(len(v.tokens) == 1 and v.reason is None for v in verdicts) and not any(drafts)
    if continuation is not None and plain:
        token_of = {rid: v.tokens[0] for rid, v in zip(rids, verdicts, strict=True)}
        hopmarks.mark("submit", continuation)
        with contextlib.suppress(StageError):  # the step is run again on its own and fails there by name
            ahead = head_step(stage, continuation, [[token_of[e.request_id]] for e in continuation], True)
    return VerifyTurn(verdicts, drafts, us, sampled_at, ahead, tuple(draft_s))


@dataclass(frozen=True)
class Ahead:
    """What the head's model thread needs to send steps ahead for a request (kafila.engine.draft
    `propose_ahead`): the history its steps in the ring assume (prompt, answer, every token they
    carry after their first), its measurements, the tokens it may still take after them (its
    max_tokens' and its context's), how many steps at most, and its draft model's proposer."""

    rid: int
    assumed: Sequence[int]
    stats: DraftStats
    room: int
    count: int
    proposer: Proposer | None = None
    catch_up: Callable[[Sequence[int]], None] | None = None  # the draft model's (DraftModel.catch_up)


@dataclass(frozen=True)
class AheadStep:
    """One step sent ahead: where it starts, what it feeds, its `head_step` output, and the
    seconds its drafting took."""

    position: int
    tokens: tuple[int, ...]
    out: tuple[bytes, int, int]
    draft_s: float


def ahead_steps(stage: Stage, policy: DraftPolicy, ahead: Ahead) -> list[AheadStep]:
    """Up to `ahead.count` steps after the request's newest, each on the history the ones before
    assume: its guess and draft (`propose_ahead`) embedded and through the head's blocks. Fewer
    where nothing is guessed; none where a step fails here (it is not sent: the request's own
    next step meets the error by name)."""
    assumed, room, out = list(ahead.assumed), ahead.room, []
    for _ in range(ahead.count):
        if ahead.catch_up is not None:
            ahead.catch_up(assumed)  # reading what it has not seen is not the draft's time
        began = time.perf_counter()
        tokens = propose_ahead(policy, ahead.stats, assumed, room, ahead.proposer)
        draft_s = time.perf_counter() - began
        if not tokens:
            break
        entry = t.Entry(ahead.rid, len(assumed), len(tokens))
        hopmarks.mark("submit", (entry,))
        try:
            step = head_step(stage, (entry,), [list(tokens)], True)
        except StageError:
            break
        out.append(AheadStep(entry.position, tokens, step, draft_s))
        assumed.extend(tokens)
        room -= len(tokens)
    return out
