"""The API server's connections under the limits of kafila.api.overload, with real sockets on
loopback: idle and trickling connections closed at the read deadline, bodies too; the oldest
unauthenticated connections pushed out so a keyed client gets in; a connection past the cap
closed at once; asyncio's accept failures and uvicorn's warnings logged at a bounded rate."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from asyncio import trsock

import httpx
import pytest
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kafila.api.connections import ACCEPT_FAILED, ThrottledRecords
from kafila.api.overload import EVICT_AFTER_S, LOG_EVERY_S, ApiLimits
from kafila.api.security import ApiSecurity
from kafila.api.server import ApiServer

KEY = "connections-test-key-0123"
HEADERS = {"Authorization": f"Bearer {KEY}"}
SECURITY = ApiSecurity(keys=(KEY,))


def app(bodies: list[bytes] | None = None) -> Starlette:
    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def echo(request: Request) -> PlainTextResponse:
        body = await request.body()
        if bodies is not None:
            bodies.append(body)
        return PlainTextResponse(f"{len(body)}")

    return Starlette(routes=[Route("/ok", ok), Route("/v1/echo", echo, methods=["POST"])])


async def open_idle(server: ApiServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(server.host, server.port)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """Seconds until the server closes the connection (EOF); fails after `seconds`."""
    started = time.monotonic()
    data = await asyncio.wait_for(reader.read(65536), seconds)
    assert data == b"", data  # closed without an answer
    return time.monotonic() - started


async def test_a_connection_that_sends_nothing_is_closed_at_the_read_deadline() -> None:
    server = await ApiServer(app(), security=SECURITY, limits=ApiLimits(read_timeout_s=0.5)).start()
    try:
        reader, writer = await open_idle(server)
        took = await closed_within(reader, 5)
        assert 0.4 <= took < 3, took
        writer.close()
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS) as client:
            assert (await client.get("/ok")).text == "ok"
    finally:
        await server.stop()


async def test_headers_trickling_in_past_the_deadline_are_cut_off() -> None:
    """A byte of headers at a time, each well within uvicorn's keep-alive timeout (which the
    first byte stops): without the deadline such a connection is held for good."""
    server = await ApiServer(app(), security=SECURITY, limits=ApiLimits(read_timeout_s=1.0)).start()
    try:
        reader, writer = await open_idle(server)
        started = time.monotonic()
        closed = False
        for byte in b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
            writer.write(bytes([byte]))
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), 0.1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
        took = time.monotonic() - started
        assert closed and 0.9 <= took < 4, (closed, took)
        writer.close()
    finally:
        await server.stop()


async def test_a_body_that_stops_coming_is_cut_off_and_the_app_told() -> None:
    bodies: list[bytes] = []
    server = await ApiServer(app(bodies), security=SECURITY, limits=ApiLimits(read_timeout_s=0.5)).start()
    try:
        reader, writer = await open_idle(server)
        writer.write(
            b"POST /v1/echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n" + b"x" * 10
        )
        await writer.drain()
        took = await closed_within(reader, 5)
        assert 0.4 <= took < 3, took
        writer.close()
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS) as client:
            whole = await client.post(
                "/v1/echo", content=b"y" * 100, headers={"Content-Type": "application/json"}
            )
            assert whole.text == "100"
        assert bodies == [b"y" * 100]  # the cut one never reached the app as a whole body
    finally:
        await server.stop()


async def test_idle_unauthenticated_connections_make_room_for_a_keyed_client() -> None:
    limits = ApiLimits(max_connections=50, max_unauthenticated=4, read_timeout_s=30)
    server = await ApiServer(app(), security=SECURITY, limits=limits).start()
    try:
        idle = [await open_idle(server) for _ in range(4)]
        late = [await open_idle(server) for _ in range(3)]
        for reader, _ in late:  # the four before them had no time yet to send headers: refused
            assert await closed_within(reader, 5) < 1
        assert len(server.guard.book.unauthenticated) == 4
        await asyncio.sleep(EVICT_AFTER_S)
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=10) as client:
            assert (await client.get("/ok")).text == "ok"  # pushed out the oldest idle one
            assert len(server.guard.book.open) - len(server.guard.book.unauthenticated) == 1
        await closed_within(idle[0][0], 5)  # long before the read deadline
        idle += late
        for _, writer in idle:
            writer.close()
    finally:
        await server.stop()


async def test_past_the_connection_cap_a_new_connection_is_closed_at_once() -> None:
    limits = ApiLimits(max_connections=2, max_unauthenticated=2, read_timeout_s=30)
    server = await ApiServer(app(), security=SECURITY, limits=limits).start()
    clients = [httpx.AsyncClient(base_url=server.url, headers=HEADERS) for _ in range(2)]
    try:
        for client in clients:  # two kept-alive connections that showed the key
            assert (await client.get("/ok")).text == "ok"
        reader, writer = await open_idle(server)
        assert await closed_within(reader, 5) < 1
        writer.close()
        assert (await clients[0].get("/ok")).text == "ok"  # those kept are served on
    finally:
        for client in clients:
            await client.aclose()
        await server.stop()


async def test_accept_failures_are_one_event_per_interval_and_other_errors_pass_on() -> None:
    """asyncio reports each failed accept (out of descriptors) to the loop's exception handler,
    which logged each with a traceback; the server's handler logs one event per interval."""
    loop = asyncio.get_running_loop()
    passed_on: list[str] = []
    loop.set_exception_handler(lambda _loop, context: passed_on.append(context["message"]))
    server = await ApiServer(app(), security=SECURITY).start()
    try:
        failure = {
            "message": ACCEPT_FAILED,
            "exception": OSError(errno.EMFILE, "Too many open files"),
            "socket": trsock.TransportSocket(server.sock),
        }
        with structlog.testing.capture_logs() as logs:
            for _ in range(2048):
                loop.call_exception_handler(failure)
            loop.call_exception_handler({"message": "something else"})
            with socket.socket() as other:  # another listener's failure is not this server's
                loop.call_exception_handler({**failure, "socket": trsock.TransportSocket(other)})
        events = [e for e in logs if e["event"] == "api_accept_failed"]
        assert len(events) == 1 and "Too many open files" in events[0]["error"], events
        assert passed_on == ["something else", ACCEPT_FAILED]
    finally:
        await server.stop()
        loop.set_exception_handler(None)
    assert loop.get_exception_handler() is None


def test_uvicorn_warnings_pass_once_per_interval_with_the_count_left_out() -> None:
    now = [0.0]
    records = ThrottledRecords(clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, None)

    assert records.filter(record("Invalid HTTP request received."))
    assert not any(records.filter(record("Invalid HTTP request received.")) for _ in range(500))
    assert records.filter(record("another message"))  # each message has its own interval
    now[0] = 11.0
    later = record("Invalid HTTP request received.")
    assert records.filter(later)
    assert later.getMessage() == "Invalid HTTP request received. (500 more like it left out)"


async def test_a_websocket_upgrade_is_served_as_plain_http_and_its_connection_not_kept_counted() -> None:
    """An upgraded connection would leave the guarded protocol without a word: asked for again
    and again, such connections would fill the cap with ones long gone."""
    server = await ApiServer(app(), security=SECURITY).start()
    try:
        for _ in range(3):
            reader, writer = await open_idle(server)
            writer.write(
                b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n"
            )
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(65536), 5)
            assert answer.startswith(b"HTTP/1.1 200"), answer
            writer.close()
        deadline = time.monotonic() + 5
        while server.guard.book.open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not server.guard.book.open
    finally:
        await server.stop()


@pytest.mark.parametrize("keys", [(), (KEY,)])
async def test_without_keys_headers_admit_a_connection_with_keys_only_the_key(keys: tuple[str, ...]) -> None:
    server = await ApiServer(app(), security=ApiSecurity(keys=keys)).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            await client.get("/ok")  # no key: admitted only where none is asked
            book = server.guard.book
            assert len(book.unauthenticated) == (1 if keys else 0) and len(book.open) == 1
    finally:
        await server.stop()


SERVER_OUT_OF_DESCRIPTORS = """
import asyncio, os, resource, sys
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from kafila.api.server import ApiServer
from kafila.obs.log import configure_logging

async def ok(request):
    return PlainTextResponse("ok")

async def main():
    configure_logging("json")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    # a few descriptors past those open now: accepts fail long before the connection cap is reached
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 24, hard))
    server = await ApiServer(Starlette(routes=[Route("/ok", ok)])).start()
    print(server.port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until told
    await server.stop()

asyncio.run(main())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_server_out_of_descriptors_logs_its_failed_accepts_once_per_interval_and_serves_after() -> None:
    """The real path: a server process left a few descriptors, 300 idle connections against it.
    asyncio fails to accept for every queued connection on each try (once a second), and logged
    each failure with its traceback (71,593 in 45 s); now one event per interval says so."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_OUT_OF_DESCRIPTORS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        flood = time.monotonic()
        idle = [socket.socket() for _ in range(300)]
        for sock in idle:  # not waited for: those past the listen queue wait for the server
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
        time.sleep(3.5)  # three or four accept retries, each failing for the queue
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/ok", timeout=5)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not answer after the flood"
                time.sleep(0.2)
        assert answer.text == "ok"
        flooded_s = time.monotonic() - flood
        proc.stdin.write("\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    failed = [e for e in events if e["event"] == "api_accept_failed"]
    # one event per throttle interval while accepts fail (10 s; a flood that outlasts it under
    # load, as when the queued connections drain slowly, gives a second with the count left out)
    most = 1 + math.ceil(flooded_s / LOG_EVERY_S)
    assert 1 <= len(failed) <= most and "Too many open files" in failed[0]["error"], err[-3000:]
    assert "Traceback" not in err and len(err) < 20_000, err[-3000:]
