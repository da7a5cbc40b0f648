"""The host's end of a spare's relay: requests a spare's API took arrive over its control link
(kafila.proto.session's `ask`), and the host answers each through its own API app and ring role
exactly as it answers its own clients (queue, re-plans, carried requests, errors and their status
codes), except that the request names the spare as the member that asked: the head's records say
so (`RingHead`'s `asker`, carried in the ring's Generate). The answer goes back as it is sent:
`reply` (status, headers), then `chunk`s of the body. A spare's `drop` (its client left) or its
link closing is a client disconnecting: the app cancels the request as for its own clients."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from kafila.api.app import create_app
from kafila.api.asks import answer_headers
from kafila.api.errors import ApiError, render
from kafila.api.service import Sampling
from kafila.api.state import Api
from kafila.net.errors import LinkError
from kafila.net.link import Link
from kafila.obs.log import get_logger
from kafila.proto import session as sm
from kafila.session.ring.generation import QueueGeneration
from kafila.session.ring.head import RingHead
from kafila.session.ring.member import RingMember

log = get_logger("kafila.session.ring.relay")

CHUNK_BYTES = 1 << 20  # a body the app sends at once travels in chunks of at most this


class AskedBy:
    """The host's ring role as a generation service whose requests name `asker` as the member that
    asked (the role is read at each call: a re-plan may make the host's member the head)."""

    def __init__(self, role: Callable[[], RingHead | RingMember], asker: str) -> None:
        self.role, self.asker = role, asker

    @property
    def context(self) -> int:
        return self.role().context

    async def submit(self, prompt: Sequence[int], sampling: Sampling) -> QueueGeneration:
        return await self.role().submit(prompt, sampling, asker=self.asker)

    def describe(self) -> dict[str, Any]:
        return self.role().describe()


def relay_app(api: Api, role: Callable[[], RingHead | RingMember], asker: str) -> Starlette:
    """The host's own API app (unguarded: the spare's guard checked the client), its requests
    named as `asker`'s."""
    return create_app(replace(api, service=AskedBy(role, asker)))


class SpareAsks:
    """The host's side of one spare's relay on `link`: each `ask` runs through `app` (None: the
    host serves no API, --api off, and says so with a 503)."""

    def __init__(self, spare: str, link: Link, app: Starlette | None) -> None:
        self.spare, self.link, self.app = spare, link, app
        self._running: dict[int, tuple[asyncio.Task[None], asyncio.Event]] = {}
        link.handlers[sm.RELAY_KIND] = self._heard
        link.on_close.append(self.close)

    def _heard(self, data: bytes) -> None:
        try:
            msg = sm.parse_relay(data)
        except sm.SessionMessageError as exc:
            log.warning("relay_message_ignored", peer=self.spare, reason=str(exc))
            return
        if isinstance(msg, sm.Ask) and msg.ask not in self._running:
            gone = asyncio.Event()
            task = asyncio.ensure_future(self._answer(msg, gone))
            self._running[msg.ask] = (task, gone)
            task.add_done_callback(lambda _: self._running.pop(msg.ask, None))
        elif isinstance(msg, sm.Drop) and msg.ask in self._running:
            self._running[msg.ask][1].set()  # the app sees its client disconnect
        else:
            log.info("relay_message_ignored", peer=self.spare, op=msg.OP, ask=msg.ask)

    def close(self) -> None:
        """The spare's link closed: its requests end as if their clients left."""
        for task, gone in list(self._running.values()):
            gone.set()
            task.cancel()
        self._running.clear()

    async def _answer(self, ask: sm.Ask, gone: asyncio.Event) -> None:
        log.info("relayed_request", spare=self.spare, ask=ask.ask, path=ask.path)
        started = False
        body_sent = [False]

        async def receive() -> Message:
            if not body_sent[0]:
                body_sent[0] = True
                return {"type": "http.request", "body": ask.content, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                await self._send(sm.Reply(ask.ask, message["status"], answer_headers(raw)))
            elif message["type"] == "http.response.body":
                await self._body(ask.ask, bytes(message.get("body", b"")), message.get("more_body", False))

        try:
            await (self.app or _no_api)(_scope(ask, self.spare), receive, send)
        except Exception as exc:
            if self.link.closed:  # (the app may wrap the LinkError its send raised in a group)
                log.info("relayed_request_cut", spare=self.spare, ask=ask.ask, reason=str(self.link.error))
                return
            # a fault of the app: the spare's client hears it as the host's would
            log.error("relayed_request_failed", spare=self.spare, ask=ask.ask, error=repr(exc), exc_info=exc)
            with contextlib.suppress(LinkError):
                if not started:
                    await self._send(sm.Reply(ask.ask, 500, (("content-type", "text/plain"),)))
                await self._send(sm.Chunk(ask.ask, f"internal error: {exc!r}".encode(), True))

    async def _body(self, ask: int, data: bytes, more: bool) -> None:
        for at in range(0, max(len(data), 1), CHUNK_BYTES):
            part = data[at : at + CHUNK_BYTES]
            await self._send(sm.Chunk(ask, part, not more and at + CHUNK_BYTES >= len(data)))

    async def _send(self, msg: sm.RelayMessage) -> None:
        await self.link.send(sm.RELAY_KIND, sm.encode_relay(msg))


def _scope(ask: sm.Ask, spare: str) -> dict[str, Any]:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in ask.headers]
    headers.append((b"content-length", str(len(ask.content)).encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": ask.method,
        "scheme": "http",
        "path": ask.path,
        "raw_path": ask.path.encode("utf-8", "surrogateescape"),
        "query_string": ask.query.encode("latin-1", "replace"),
        "root_path": "",
        "headers": headers,
        "client": (f"spare {spare}", 0),
        "server": ("kafila-relay", 0),
    }


async def _no_api(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer of a host that serves no API (--api off): it cannot answer a spare's requests."""
    error = ApiError(503, "host_serves_no_api", NO_API)
    await render(Request(scope, receive), error)(scope, receive, send)


NO_API = (
    "this member waits as a spare and relays its requests to the host, which serves no API (--api off), "
    "so it answers none; ask a member of the ring"
)
