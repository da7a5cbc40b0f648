"""Starlette app of the rendezvous: WebSocket signaling at /v1/signal, /healthz, /metrics.

A thin asyncio shell around `Registry`: each connection gets an id and an outbox drained by a
writer task; frames are decoded with the strict parser and fed to the registry with `now`; the
events it returns are carried out here. A tick task times out silent members and expires codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from kafila.obs.log import get_logger
from kafila.proto import signaling as sig
from kafila.proto.errors import ProtocolError
from kafila.rendezvous.metrics import make_registry
from kafila.rendezvous.ratelimit import TokenBuckets
from kafila.rendezvous.registry import Close, ConnId, Event, Note, Registry, Send

log = get_logger("kafila.rendezvous")
LOG_REFUSALS_PER_MINUTE = 10  # per event and source address; the metrics count every one


def _refusal(note: Note) -> bool:
    """A note of something refused (a join that failed, a malformed frame, a connection over a limit)."""
    if note.event == "join":
        return note.fields.get("outcome") != "ok"
    return note.event in ("bad_frame", "connection_refused")


OUTBOX_LIMIT = 1000  # queued frames before a connection that does not read is dropped
_CloseReq = tuple[int, str]


class SignalingHub:
    def __init__(self, registry: Registry, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.clock = clock
        self._ids = itertools.count(1)
        self._outboxes: dict[ConnId, asyncio.Queue[str | _CloseReq]] = {}
        self._log_budget = TokenBuckets(LOG_REFUSALS_PER_MINUTE / 60, LOG_REFUSALS_PER_MINUTE)
        self._unlogged: Counter[str] = Counter()  # refusals sampled out, per event and source

    def apply(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Send):
                try:
                    text = sig.encode(event.message, event.version)
                except (ValueError, TypeError) as exc:  # a bug: drop this message, not the connection
                    kind = event.message.TYPE
                    log.error("message_not_encoded", conn=event.conn, message=kind, error=str(exc))
                    continue
                self._enqueue(event.conn, text)
            elif isinstance(event, Close):
                self._enqueue(event.conn, (event.code, event.reason))
            elif isinstance(event, Note):
                self._log(event)

    def _log(self, note: Note) -> None:
        """One line per note; refusals per source address sampled (10 a minute, then the count of
        those left out), so one client's attempts cannot write the log at 500 lines a second."""
        fields = note.fields
        if not _refusal(note):
            log.info(note.event, **fields)
            return
        key = f"{note.event}:{fields.get('source')}"
        if not self._log_budget.take(key, self.clock()):
            self._unlogged[key] += 1
            return
        left_out = self._unlogged.pop(key, 0)
        log.info(note.event, **fields, **({"not_logged_before": left_out} if left_out else {}))

    def _enqueue(self, conn: ConnId, item: str | _CloseReq) -> None:
        box = self._outboxes.get(conn)
        if box is None:
            return
        if box.qsize() >= OUTBOX_LIMIT and isinstance(item, str):
            log.warning("outbox_full", conn=conn, queued=box.qsize())
            box.put_nowait((1008, f"not reading: {box.qsize()} messages queued"))
            return
        box.put_nowait(item)

    async def serve(self, ws: WebSocket) -> None:
        await ws.accept()
        conn = next(self._ids)
        self._outboxes[conn] = asyncio.Queue()
        source = ws.client.host if ws.client else "unknown"
        self.apply(self.registry.connect(conn, source, self.clock()))
        reader = asyncio.create_task(self._read(ws, conn))
        writer = asyncio.create_task(self._write(ws, conn))
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:  # a connection never ends on a failure nobody hears of
                if not task.cancelled() and task.exception() is not None:
                    log.error("connection_failed", conn=conn, error=repr(task.exception()))
        finally:
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            self._outboxes.pop(conn, None)
            self.apply(self.registry.disconnect(conn, self.clock()))

    async def _read(self, ws: WebSocket, conn: ConnId) -> None:
        limit = self.registry.limits.max_message_bytes
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            now = self.clock()
            if message.get("text") is None:
                err = ProtocolError("binary frames are not part of the protocol; send JSON text")
                self.apply(self.registry.bad_frame(conn, err, now))
                continue
            try:
                msg = sig.decode_client(message["text"], limit)
            except ProtocolError as exc:
                self.apply(self.registry.bad_frame(conn, exc, now))
                continue
            try:
                events = self.registry.receive(conn, msg, now)
            except Exception as exc:  # a bug must not end the connection without a reason
                log.exception("internal_error", conn=conn, message=msg.TYPE)
                events = [Send(conn, sig.Error("internal", f"rendezvous failed on '{msg.TYPE}': {exc}"))]
            self.apply(events)

    async def _write(self, ws: WebSocket, conn: ConnId) -> None:
        box = self._outboxes[conn]
        while True:
            item = await box.get()
            if isinstance(item, tuple):
                with contextlib.suppress(Exception):
                    await ws.close(item[0], item[1])
                return
            try:
                await ws.send_text(item)
            except WebSocketDisconnect:  # the peer went as we wrote to it (it left): not a failure
                return

    async def tick_forever(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            self.apply(self.registry.tick(self.clock()))


def _signal_url(request: Request) -> str:
    """The signaling URL as this request reached the rendezvous: ws://, or wss:// behind TLS."""
    scheme = "wss" if request.url.scheme == "https" else "ws"
    return str(request.url.replace(scheme=scheme, path=sig.SIGNAL_PATH, query=""))


async def _upgrade_required(request: Request) -> Response:
    """Plain HTTP on the signaling path: say it is a WebSocket endpoint (426, RFC 9110 15.5.22)."""
    url = _signal_url(request)
    body = {
        "error": "upgrade_required",
        "message": f"{sig.SIGNAL_PATH} is the rendezvous's WebSocket signaling endpoint: "
        f"connect to {url} with a WebSocket client (ws://, or wss:// when served with TLS)",
    }
    return JSONResponse(body, status_code=426, headers={"Upgrade": "websocket"})


async def _index(request: Request) -> Response:
    """What a person opening the rendezvous's address in a browser or with curl finds: what it is
    and where its endpoints are (it answered a bare 404)."""
    from kafila import __version__

    body = {
        "service": "kafila rendezvous",
        "version": __version__,
        "signaling": _signal_url(request),
        "members": f"kafila host/join --rendezvous {request.url.netloc}",
        "endpoints": ["/healthz", "/metrics", sig.SIGNAL_PATH],
    }
    return JSONResponse(body)


def build_app(
    registry: Registry,
    udp_stats: dict[str, int] | None = None,
    clock: Callable[[], float] = time.monotonic,
    tick_s: float = 1.0,
) -> Starlette:
    hub = SignalingHub(registry, clock)
    prom = make_registry(registry, udp_stats)

    async def healthz(request: Request) -> Response:
        body: dict[str, Any] = {
            "status": "ok",
            "sessions": len(registry.sessions),
            "members": registry.member_count,
            "udp_port": registry.probe.port,
        }
        return JSONResponse(body)

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(prom), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        ticker = asyncio.create_task(hub.tick_forever(tick_s))
        try:
            yield
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            log.info("rendezvous_stopped")  # also on SIGTERM (docker stop): uvicorn then re-raises it

    app = Starlette(
        routes=[
            Route("/", _index),
            Route("/healthz", healthz),
            Route("/metrics", metrics),
            WebSocketRoute(sig.SIGNAL_PATH, hub.serve),
            Route(sig.SIGNAL_PATH, _upgrade_required),  # plain HTTP on the same path (http scope only)
        ],
        lifespan=lifespan,
    )
    app.state.hub = hub
    return app
