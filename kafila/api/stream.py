"""Running one job against the generation service: text pieces, streaming and collected.

A client that disconnects cancels its request: streaming responses watch the ASGI receive
channel while they send, collected responses race the generation against the disconnect.

While the ring re-plans around a lost member (the service's /session state is "replanning") a
request is held, not failed, and no token comes for seconds: every `KEEPALIVE_S` of that silence
the stream gets a `Piece` marked `replanning`, which each API writes as something its clients skip
(an SSE comment, an empty NDJSON chunk), so the connection and the people watching it know it lives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from kafila.api.errors import ApiError
from kafila.api.params import Job
from kafila.api.service import STOP_STRING, Generation, GenerationError, GenerationService, TokenEvent
from kafila.api.text import Detokenizer, TextCodec
from kafila.obs.log import get_logger

log = get_logger("kafila.api")

KEEPALIVE_S = 2.0  # s of silence while re-planning between two keep-alives of a stream


@dataclass
class Piece:
    text: str
    finish: str | None = None
    queue_position: int | None = None  # the request waits for a slot (1 = next)
    replanning: bool = False  # the ring re-plans; the request is held (a keep-alive, no text)


@dataclass
class Tally:
    """What the final chunk and the usage block report."""

    prompt_tokens: int
    completion_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    text: list[str] = field(default_factory=list)
    finish: str = "stop"
    drafted: int = 0  # drafted tokens verified for the answer (speculative decoding)
    accepted: int = 0  # ... and kept


async def start(service: GenerationService, job: Job) -> Generation:
    try:
        return await service.submit(job.prompt, job.sampling)
    except GenerationError as exc:
        raise ApiError.from_generation(exc) from exc


def replanning(service: GenerationService) -> bool:
    """Whether the service holds its requests while the ring re-plans (its /session state)."""
    return bool(service.describe().get("state") == "replanning")


async def ticking(events: AsyncIterable[TokenEvent], every: float) -> AsyncIterator[TokenEvent | None]:
    """The events, and None after each `every` s in which none came (the wait goes on)."""
    it = aiter(events)
    nxt: asyncio.Future[TokenEvent] | None = None
    try:
        while True:
            nxt = nxt or asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({nxt}, timeout=every)
            if not done:
                yield None
                continue
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield ev
    finally:
        if nxt is not None and not nxt.done():
            nxt.cancel()


async def pieces(
    gen: Generation,
    codec: TextCodec,
    job: Job,
    tally: Tally,
    paused: Callable[[], bool] = lambda: False,
    every: float = KEEPALIVE_S,
) -> AsyncIterator[Piece]:
    """The request's text pieces; `paused()` says the ring re-plans: then each `every` s of
    silence is a keep-alive piece."""
    detok = Detokenizer(codec, job.stop)
    try:
        async for ev in ticking(gen, every):
            if ev is None:
                if paused():
                    yield Piece("", replanning=True)
                continue
            if ev.queue_position:
                yield Piece("", queue_position=ev.queue_position)
            tally.drafted, tally.accepted = tally.drafted + ev.drafted, tally.accepted + ev.accepted
            if ev.tokens:
                tally.first_token = tally.first_token or time.perf_counter()
                tally.completion_tokens += len(ev.tokens)
                text = detok.feed(ev.tokens)
                if detok.stopped:
                    gen.cancel(STOP_STRING)  # finished, not abandoned: the head records it so
                    yield _end(tally, text, "stop")
                    return
                if text:
                    tally.text.append(text)
                    yield Piece(text)
            if ev.finish:
                yield _end(tally, detok.flush(), ev.finish)
                return
    finally:
        gen.cancel("client gone")


def _end(tally: Tally, text: str, finish: str) -> Piece:
    tally.text.append(text)
    tally.finish, tally.finished = finish, time.perf_counter()
    return Piece(text, finish)


async def collect(request: Request, stream: AsyncIterator[Piece], gen: Generation) -> None:
    """Run the stream to its end, or cancel it when the client disconnects first."""

    async def drain() -> None:
        async for _ in stream:
            pass

    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            gen.cancel("client disconnected")
            log.info("client_disconnected", path=request.url.path, request_id=gen.request_id)
    try:
        await work
    except asyncio.CancelledError:
        if not work.cancelled():  # this task itself is being cancelled
            raise
        raise ClientGone from None  # nobody to answer (it was an "Exception in ASGI application")
    except GenerationError as exc:
        raise ApiError.from_generation(exc) from exc


class ClientGone(Exception):
    """The client of a non-streaming request went away before its answer: nothing to send."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ChunkStream:
    """An ASGI response sending encoded chunks; a disconnect cancels the generation."""

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        gen: Generation,
        media_type: str,
        on_error: Callable[[ApiError], bytes],
    ) -> None:
        self.chunks, self.gen, self.media_type, self.on_error = chunks, gen, media_type, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", self.media_type.encode()), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        sender = asyncio.ensure_future(self._send_all(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        await asyncio.wait({sender, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not sender.done():
            sender.cancel()
            self.gen.cancel("client disconnected")
            log.info("client_disconnected", path=scope.get("path"), request_id=self.gen.request_id)
        gone.cancel()
        await asyncio.gather(sender, gone, return_exceptions=True)

    async def _send_all(self, send: Send) -> None:
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except GenerationError as exc:
            body = self.on_error(ApiError.from_generation(exc))
            await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            self.gen.cancel("stream ended")
        await send({"type": "http.response.body", "body": b"", "more_body": False})
