"""The API of a spare: a member the host keeps out of the ring serves every route by relaying it
over its control link to the host, whose API answers it as its own clients' (through the host's
ring role, to whichever member is the head: kafila.session.ring.relay) and streams the answer
back. The client gets what the host's API would give it: the same routes (OpenAI and Ollama,
streaming and not), the same status codes (a full queue's 429, a re-plan's 503), the same bytes.
/session, /healthz and /metrics stay this member's own. Once the host plans the spare into the
ring, the server switches to the member's own app (kafila.api.server.ApiServer.switch); requests
relayed before then go on over the control link until their answers end. A spare whose control
link went answers 503 saying so (kafila.api.asks)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kafila.api.asks import Asks, Body, Event, Failed, Started, Unreachable
from kafila.api.errors import ApiError, render
from kafila.api.forming import METHODS, FormingStatus, forming_app
from kafila.net.errors import LinkError
from kafila.net.link import Link
from kafila.obs.log import get_logger
from kafila.proto import session as sm

log = get_logger("kafila.api.spare")


class SpareRelay:
    """The spare's end of the relay on its control link to `host` (the pure `Asks` decides)."""

    def __init__(self, link: Link, host: str) -> None:
        self.link, self.asks = link, Asks(host)
        self._answers: dict[int, asyncio.Queue[Event]] = {}
        self._sending: set[asyncio.Task[None]] = set()
        link.handlers[sm.RELAY_KIND] = self._heard
        link.on_close.append(self._closed)
        if link.closed:
            self._closed()

    @property
    def gone(self) -> str | None:
        return self.asks.gone

    async def ask(self, request: Request, content: bytes) -> tuple[int, asyncio.Queue[Event]]:
        """Relay `request` (its body `content`): its number and the queue its answer arrives on.
        Unreachable when the link is gone, now or while sending."""
        msg = self.asks.ask(
            request.method, request.url.path, request.url.query, request.headers.items(), content
        )
        answers = self._answers[msg.ask] = asyncio.Queue()
        try:
            await self.link.send(sm.RELAY_KIND, sm.encode_relay(msg))
        except LinkError as exc:
            self._closed(str(exc))
            raise Unreachable(self.asks.refusal()) from exc
        log.info("request_relayed", ask=msg.ask, path=msg.path, host=self.asks.host, bytes=len(content))
        return msg.ask, answers

    def drop(self, ask: int) -> None:
        """The client of `ask` left (or its answer ended): the host stops it, if it is still open."""
        self._answers.pop(ask, None)
        msg = self.asks.drop(ask)
        if msg is not None:
            task = asyncio.ensure_future(self._send(msg))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, msg: sm.RelayMessage) -> None:
        with contextlib.suppress(LinkError):
            await self.link.send(sm.RELAY_KIND, sm.encode_relay(msg))

    def _heard(self, data: bytes) -> None:
        try:
            msg = sm.parse_relay(data)
        except sm.SessionMessageError as exc:
            log.warning("relay_message_ignored", peer=self.asks.host, reason=str(exc))
            return
        for event in self.asks.heard(msg):
            self._deliver(event)

    def _closed(self, why: str | None = None) -> None:
        reason = why or str(self.link.error or "the link closed")
        for event in self.asks.lost(reason):
            self._deliver(event)
        if self.asks.gone == reason:
            log.warning("relay_link_lost", host=self.asks.host, reason=reason)

    def _deliver(self, event: Event) -> None:
        answers = self._answers.get(event.ask)
        if answers is not None:
            answers.put_nowait(event)
        if isinstance(event, Failed) or (isinstance(event, Body) and event.end):
            self._answers.pop(event.ask, None)


def spare_app(status: FormingStatus, relay: SpareRelay) -> Starlette:
    """The spare's API: /session, /healthz and /metrics its own (as while forming), every other
    route relayed to the host."""
    own = forming_app(status)

    async def healthz(request: Request) -> Response:
        if relay.gone is not None:
            doc = {"ok": False, "state": "spare", "error": relay.asks.refusal()}
            return JSONResponse(doc, status_code=503)
        return JSONResponse({"ok": True, "state": "spare"})

    async def relayed(request: Request) -> Response:
        return await _relay(request, relay)

    routes = [r for r in own.routes if getattr(r, "path", "") in ("/session", "/metrics")]
    routes += [Route("/healthz", healthz, methods=["GET"]), Route("/{path:path}", relayed, methods=METHODS)]
    return Starlette(routes=routes)


async def _relay(request: Request, relay: SpareRelay) -> Response:
    try:
        content = await _body(request)
        ask, answers = await relay.ask(request, content)
    except ApiError as exc:
        return render(request, exc)
    except Unreachable as exc:
        return render(request, ApiError(503, "host_unreachable", str(exc)))
    except ClientDisconnect:
        return Response(status_code=499)
    try:
        first = await _first(request, answers)
    except BaseException:
        relay.drop(ask)
        raise
    if first is None:  # the client left while the host worked on it
        relay.drop(ask)
        return Response(status_code=499)
    if isinstance(first, Failed):
        return render(request, ApiError(503, "host_unreachable", first.reason))
    assert isinstance(first, Started)
    headers = dict(first.headers)
    return StreamingResponse(_chunks(ask, answers, relay), status_code=first.status, headers=headers)


async def _body(request: Request) -> bytes:
    """The request's body, refused with 413 past what a spare relays."""
    most = sm.MAX_ASK_BODY
    said = request.headers.get("content-length")
    if said is not None and said.isdigit() and int(said) > most:
        raise ApiError(413, "body_too_large", f"a body of {said} bytes; a spare relays at most {most}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > most:
            raise ApiError(413, "body_too_large", f"a body of more than {most} bytes; a spare relays no more")
        parts.append(part)
    return b"".join(parts)


async def _first(request: Request, answers: asyncio.Queue[Event]) -> Event | None:
    """The first event of an answer, or None when the client disconnects first (a collected
    answer comes whole: the host may work on it for a long time)."""
    got = asyncio.ensure_future(answers.get())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not got.done():
            got.cancel()
    return got.result() if got.done() and not got.cancelled() else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        continue


async def _chunks(ask: int, answers: asyncio.Queue[Event], relay: SpareRelay) -> AsyncIterator[bytes]:
    """The answer's bytes as they come; a link lost midway ends the body where it got to (the
    status went out already), and the log says why. Leaving early drops the request at the host."""
    started = time.monotonic()
    try:
        while True:
            event = await answers.get()
            if isinstance(event, Failed):
                log.warning("relayed_answer_cut", ask=ask, reason=event.reason)
                return
            assert isinstance(event, Body)
            if event.data:
                yield event.data
            if event.end:
                log.info("relayed_answer_done", ask=ask, s=round(time.monotonic() - started, 3))
                return
    finally:
        relay.drop(ask)
