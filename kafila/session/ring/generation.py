"""A request's event stream as the API sees it, fed by the head (local) or by Tokens messages
arriving over the ring (a request forwarded from a member that is not the head). Request ids
carry the origin tag of the member that took them (kafila.session.ring.origins), so every member
can tell whether a Tokens message is its own or has to travel on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from kafila.api.service import GenerationError, TokenEvent
from kafila.obs.log import get_logger

log = get_logger("kafila.session.ring.generation")


async def cancel_tasks(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel and wait; cancels again while any is still running (Python 3.11's wait_for can lose a
    cancellation that arrives as its inner future completes, leaving a receive loop running)."""
    for _ in range(20):
        pending = [t for t in tasks if not t.done()]
        if not pending:
            return
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=0.25)


def guarded(
    loop: Callable[[], Awaitable[None]], member: str, break_ring: Callable[[str], None]
) -> asyncio.Task[None]:
    """A task running one of `member`'s ring loops. An exception that is not a cancellation (not a
    StageError either, which is answered per request: the backend out of memory, say) is logged and
    breaks the ring with the error named, instead of ending the task unseen, which would leave every
    request waiting for a step, a frame or an answer that no task is left to pass on."""

    async def run() -> None:
        try:
            await loop()
        except Exception as exc:
            log.error("member_failed", member=member, error=repr(exc), exc_info=exc)
            break_ring(f"member {member}: internal error {exc!r}")

    return asyncio.ensure_future(run())


class QueueGeneration:
    """Events pushed by the session, read by the API; `cancel` calls back into the session once."""

    def __init__(self, request_id: int, on_cancel: Callable[[int, str], None]) -> None:
        self.request_id = request_id
        self._events: asyncio.Queue[TokenEvent | GenerationError] = asyncio.Queue()
        self._on_cancel = on_cancel
        self.finished = False

    def push(self, item: TokenEvent | GenerationError) -> None:
        if not self.finished:
            self._events.put_nowait(item)
            self.finished = isinstance(item, GenerationError) or item.finish is not None

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while not (self.finished and self._events.empty()):
            item = await self._events.get()
            if isinstance(item, GenerationError):
                raise item
            yield item

    def cancel(self, reason: str = "cancelled") -> None:
        if not self.finished:
            self.finished = True
            self._on_cancel(self.request_id, reason)

    def answered_by(self, on_cancel: Callable[[int, str], None]) -> None:
        """The request moved to another service (a member that became the head): its cancel goes there."""
        self._on_cancel = on_cancel
