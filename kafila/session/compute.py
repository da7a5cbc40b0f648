"""What a member's model thread does: stage steps on wire bytes (runs only on that thread).

`ModelThread` is the one thread that owns a member's Stage; the asyncio shell submits functions to
it and awaits their results. The functions below turn tensor frames into stage steps and back:
hidden states cross the thread boundary only as bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from kafila.engine.pace import Mark, Pace
from kafila.engine.stage import Entry as StageEntry
from kafila.engine.stage import Stage, StageError
from kafila.obs import hopmarks
from kafila.proto import tensor as t

T = TypeVar("T")
WIRE = {"F32": t.DType.F32, "F16": t.DType.F16, "BF16": t.DType.BF16}


class ModelThread:
    """A single-thread executor: every call on the member's Stage runs here, in order."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{name}")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def open_new(stage: Stage, entries: Sequence[t.Entry]) -> None:
    """Give a KV slot to every request seen here for the first time (its position 0)."""
    for e in entries:
        if e.position == 0 and e.request_id not in stage.open_requests:
            stage.open(e.request_id)


def head_step(
    stage: Stage, entries: Sequence[t.Entry], tokens: Sequence[Sequence[int]]
) -> tuple[bytes, int, int]:
    """Embed each entry's tokens and run the head's blocks: (wire bytes [N, H], rows, microseconds)."""
    hopmarks.mark("start", entries)
    start = Pace.mark()
    open_new(stage, entries)
    ids = [tok for toks in tokens for tok in toks]
    hidden = stage.embed(ids)  # [N, H]
    out = stage.step(hidden, [StageEntry(e.request_id, e.position, e.n_tokens) for e in entries])
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
    out = stage.step(hidden, [StageEntry(e.request_id, e.position, e.n_tokens) for e in entries])
    datas, at = [], 0
    for f in frames:
        rows = f.shape[0]
        datas.append(stage.to_bytes(out[at : at + rows]))
        at += rows
    us = _us(stage, start)
    hopmarks.mark("end", frames[0].entries)
    return datas, us


def head_logits(stage: Stage, frame: t.Hidden, rids: Sequence[int]) -> tuple[np.ndarray, int]:
    """The last row of each named request's rows -> logits [B, V] (float32), microseconds."""
    hopmarks.mark("l_start", frame.entries)
    start = Pace.mark()
    check_dtype(stage, frame)
    hidden = stage.from_bytes(frame.data, frame.shape)  # [N, H]
    last, at = {}, 0
    for e in frame.entries:
        at += e.n_tokens
        last[e.request_id] = at - 1
    rows = hidden[[last[r] for r in rids]]  # [B, H]
    logits = stage.logits(rows)
    us = _us(stage, start)
    hopmarks.mark("l_end", frame.entries)
    return logits, us


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


def close_slots(stage: Stage, rids: Sequence[int]) -> None:
    for rid in rids:
        stage.close(rid)


def _us(stage: Stage, start: Mark) -> int:
    """Microseconds since `start`, after the stage's emulated pace has idled (see engine.pace)."""
    return int(stage.pace.finish(start) * 1e6)
