"""The model thread's step functions on wire frames (kafila.session.ring.compute)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from kafila.engine.stage import Stage, StageError
from kafila.models.checkpoint import Checkpoint
from kafila.proto import tensor as t
from kafila.session.ring import compute


@pytest.fixture(scope="module")
def head(tiny_checkpoint) -> Stage:
    ckpt = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))
    return Stage.load(ckpt, range(0, 2), True, backend="torch", dtype="fp32", context=32)


def frame(dtype: t.DType, rows: int, hidden: int) -> t.Hidden:
    data = np.zeros((rows, hidden), np.float32 if dtype is t.DType.F32 else np.uint16).tobytes()
    return t.Hidden(0, dtype, (rows, hidden), (t.Entry(7, 0, rows),), data, 0, (10,))


def test_a_returning_frame_in_another_dtype_is_refused_at_the_head(head: Stage) -> None:
    """What the last member sends back reaches the head's logits: bf16 bytes read as fp32 would
    be half a row of wrong numbers, so both step functions refuse them by name."""
    hidden = head.model.config.hidden_size
    logits, _ = compute.head_logits(head, frame(t.DType.F32, 3, hidden), [7])
    assert logits.shape == (1, head.model.config.vocab_size)
    with pytest.raises(StageError, match=r"\[0, 2\) computes in F32 but received hidden states in BF16"):
        compute.head_logits(head, frame(t.DType.BF16, 3, hidden), [7])
    with pytest.raises(StageError, match="computes in F32 but received hidden states in BF16"):
        compute.stage_step(head, [frame(t.DType.BF16, 3, hidden)])


async def test_the_model_thread_runs_calls_in_order_on_one_thread_and_hands_back_errors() -> None:
    model = compute.ModelThread("t")
    seen: list[tuple[int, str]] = []

    def call(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    try:
        assert await asyncio.gather(*(model.run(call, i) for i in range(20))) == [i * i for i in range(20)]
        assert [i for i, _ in seen] == list(range(20))
        assert {name for _, name in seen} == {"kafila-model-t"}
        with pytest.raises(StageError, match="the stage refused"):
            await model.run(_refuse)
        assert await model.run(call, 3) == 9  # still serving after an error
    finally:
        model.close()


async def test_a_posted_call_runs_in_its_place_and_its_error_is_logged_not_raised() -> None:
    """What the head posts (its draft model reading a prompt while the prefill is in the ring)
    runs on the model thread in queue order; nobody awaits it, so its error is only logged."""
    from structlog.testing import capture_logs

    model = compute.ModelThread("t")
    seen: list[str] = []
    try:
        with capture_logs() as logs:
            model.post(seen.append, "posted")
            model.post(_refuse)
            assert await model.run(seen.append, "awaited") is None
        assert seen == ["posted", "awaited"]  # the awaited call ran after both posted ones
        [failed] = [e for e in logs if e["event"] == "model_thread_call_failed"]
        assert failed["call"] == "_refuse" and "the stage refused" in failed["error"]
        assert await model.run(lambda: 4) == 4  # still serving after the posted call's error
    finally:
        model.close()
    model.post(seen.append, "after close")  # dropped
    assert seen == ["posted", "awaited"]


async def test_a_cancelled_caller_does_not_stop_the_model_thread_and_close_drops_waiting_calls() -> None:
    model = compute.ModelThread("t")
    gate = threading.Event()
    ran: list[str] = []
    first = asyncio.ensure_future(model.run(lambda: (gate.wait(5), ran.append("first"))))
    await asyncio.sleep(0.01)
    first.cancel()  # its call is running: it ends, its result is dropped
    gate.set()
    assert await model.run(lambda: "next") == "next"
    assert ran == ["first"] and first.cancelled()

    gate.clear()
    running = asyncio.ensure_future(model.run(gate.wait, 5))
    waiting = asyncio.ensure_future(model.run(ran.append, "never"))
    await asyncio.sleep(0.01)
    model.close()
    gate.set()
    assert await running is True
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert ran == ["first"]
    with pytest.raises(RuntimeError, match="closed"):
        await model.run(ran.append, "after close")


def _refuse() -> None:
    raise StageError("the stage refused")


async def test_a_model_thread_closed_during_a_call_counts_as_work_still_running_until_it_ends() -> None:
    """The CLI ends with os._exit while such work runs: a survivor whose re-plan rebuilt its stage
    on this thread when the host ended the session exited with SIGABRT (torch still running at the
    interpreter's exit: "terminate called without an active exception")."""
    from kafila.session.progress import off_loop_busy

    model = compute.ModelThread("closing")
    gate = threading.Event()
    running = asyncio.ensure_future(model.run(gate.wait, 5))
    await asyncio.sleep(0.01)
    model.close()
    assert off_loop_busy()  # the rebuild is still in torch
    gate.set()
    assert await running is True
    model._thread.join(5)
    assert not off_loop_busy()
