"""Progress lines for the person watching and the forming member's /session, and work off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

R = TypeVar("R")


async def off_loop(fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)` on a daemon thread of its own. Unlike `asyncio.to_thread`, whose pool the loop
    joins at exit, a member stopped meanwhile (Ctrl-C, SIGTERM) ends without waiting for it: a
    probe or a stage's load takes 10 s and more, past `docker stop`'s grace period."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[R] = loop.create_future()

    def settle(outcome: tuple[bool, Any]) -> None:
        ok, value = outcome
        if done.done():  # the awaiting task was cancelled
            return
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def run() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn(*args))
        except BaseException as exc:  # handed to the awaiting task, as to_thread does
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for it any more
            loop.call_soon_threadsafe(settle, outcome)

    name = f"{OFF_LOOP}{getattr(fn, '__name__', 'work')}"
    context = contextvars.copy_context()  # as asyncio.to_thread: the caller's progress hook
    threading.Thread(target=context.run, args=(run,), name=name, daemon=True).start()
    return await done


OFF_LOOP = "kafila-off-loop-"  # the threads' names
MODEL_THREAD = "kafila-model-"  # a member's model thread (kafila.session.ring.compute.ModelThread)


def off_loop_busy() -> bool:
    """Work off the loop still runs: an `off_loop` call (the member was stopped during its probe
    or stage load), or a model thread not yet ended (closed during a call: a re-plan's rebuild of
    its stage when the host ended the session). Either, still in torch at the interpreter's exit,
    can abort it ("terminate called without an active exception", rc 134)."""
    return any(t.name.startswith((OFF_LOOP, MODEL_THREAD)) and t.is_alive() for t in threading.enumerate())


# told every progress line of the host() or join() whose task (or a task or off_loop thread it
# started) says it: the forming member's status, which its API's /session shows
_progress: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "kafila_progress", default=None
)


def say(text: str) -> None:
    """Progress for the person at the terminal (stderr; stdout stays for results)."""
    print(f"kafila: {text}", file=sys.stderr, flush=True)
    note(text)


def note(text: str) -> None:
    """What this member is doing now, for its forming status only (no line at the terminal)."""
    if (hook := _progress.get()) is not None:
        hook(text)


@contextlib.contextmanager
def progress_to(hook: Callable[[str], None]) -> Iterator[None]:
    """Within the block, tell `hook` every progress line of the calling task (and of the tasks and
    off_loop threads it starts, which keep telling it)."""
    token = _progress.set(hook)
    try:
        yield
    finally:
        _progress.reset(token)
