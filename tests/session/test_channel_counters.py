"""Channels count what they really send and receive, in total and per request (in-process pair;
the QUIC link channel counts at the same two calls, tests/session/test_session_loopback.py)."""

from __future__ import annotations

from kafila.proto import tensor as t
from kafila.session.channel import MemoryChannel


def frame(rows: dict[int, int], hidden: int = 8) -> t.Hidden:
    entries = tuple(t.Entry(rid, 0, n) for rid, n in rows.items())
    n = sum(rows.values())
    return t.Hidden(0, t.DType.F32, (n, hidden), entries, bytes(4 * n * hidden), t.Flag.PREFILL, (12,))


async def test_a_shared_frame_is_split_over_its_requests_by_rows() -> None:
    a, b = MemoryChannel.pair("a", "b")
    shared, alone = frame({1: 3, 2: 1}), frame({1: 2})
    for msg in (shared, alone, t.Control("beat")):
        await a.send(msg)
        assert await b.recv(1.0) == msg
    size = len(t.encode(shared, 1))
    one, two = a.counters.requests[1], a.counters.requests[2]
    assert one.bytes_sent + two.bytes_sent == size + len(t.encode(alone, 1))
    assert one.bytes_sent == size * 3 // 4 + len(t.encode(alone, 1))  # 3 of the shared frame's 4 rows
    assert two.bytes_sent == size - size * 3 // 4  # the last entry takes the rest of the bytes
    assert (one.messages_sent, two.messages_sent) == (2, 1)
    assert a.counters.bytes_sent == size + len(t.encode(alone, 1)) + len(t.encode(t.Control("beat"), 1))
    assert a.counters.messages_sent == 3  # the beat is counted in the totals, not for a request
    received = b.counters.take(1)
    assert (received.bytes_received, received.messages_received) == (one.bytes_sent, 2)
    assert b.counters.take(1).bytes_received == 0  # taken once
    assert a.rtt_ms is None  # no network in between
