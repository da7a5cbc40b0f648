"""The API's limits as values: fitted under the descriptor limit, the book of connections (which
one a new connection pushes out, when one is refused) and the throttle of shed-connection events."""

from __future__ import annotations

import pytest

from kafila.api.overload import (
    API_BACKLOG,
    DESCRIPTOR_RESERVE,
    EVICT_AFTER_S,
    MIN_CONNECTIONS,
    ApiLimits,
    ConnectionBook,
    Throttle,
)


def test_limits_fit_under_the_descriptor_limit_with_room_for_the_ring() -> None:
    limits = ApiLimits(max_connections=2000, max_unauthenticated=64)
    at_1024 = limits.fitted(1024)
    assert at_1024.max_connections == 1024 - API_BACKLOG - DESCRIPTOR_RESERVE == 640
    assert at_1024.max_connections + API_BACKLOG + DESCRIPTOR_RESERVE <= 1024
    assert at_1024.max_unauthenticated == 64
    assert limits.fitted(65536) == limits  # room enough: as asked
    assert ApiLimits(512).fitted(1024).max_connections == 512
    assert limits.fitted(None) == limits
    tiny = limits.fitted(256)  # less than backlog and reserve: the API keeps its least
    assert tiny.max_connections == MIN_CONNECTIONS and tiny.max_unauthenticated == MIN_CONNECTIONS


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_connections": 0}, "--api-max-connections 0"),
        ({"max_unauthenticated": 0}, "--api-max-unauthenticated 0"),
        ({"read_timeout_s": 0.0}, "--api-read-timeout must be above 0 seconds, got 0"),
    ],
)
def test_limits_that_cannot_work_are_refused_naming_the_flag(kwargs: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ApiLimits(**kwargs)  # type: ignore[arg-type]


def test_a_new_connection_pushes_out_the_oldest_unauthenticated_one() -> None:
    book: ConnectionBook[str] = ConnectionBook(ApiLimits(max_connections=10, max_unauthenticated=3))
    assert [book.admit(c, 0.0) for c in "abc"] == [(True, None)] * 3
    book.authenticated("b")  # showed its key: no longer pushed out
    assert book.admit("d", 0.5) == (True, None)  # a, c, d unauthenticated: at the cap now
    assert book.admit("e", 5.0) == (True, "a")
    assert book.admit("f", 5.0) == (True, "c")
    assert list(book.unauthenticated) == ["d", "e", "f"]
    assert book.open == {"b", "d", "e", "f"}


def test_a_connection_younger_than_the_grace_is_not_pushed_out_the_new_one_is_refused() -> None:
    """A burst accepted at one wake-up must not push out a client's connection before its headers
    were read: the newcomer is refused instead, until the oldest has had its time."""
    book: ConnectionBook[str] = ConnectionBook(ApiLimits(max_connections=10, max_unauthenticated=2))
    book.admit("client", 10.0)
    book.admit("idle", 10.0)
    assert book.admit("burst", 10.0 + EVICT_AFTER_S / 2) == (False, None)
    assert list(book.unauthenticated) == ["client", "idle"]
    assert book.admit("later", 10.0 + EVICT_AFTER_S) == (True, "client")


def test_connections_at_their_cap_push_out_an_unauthenticated_one_else_refuse_the_new_one() -> None:
    book: ConnectionBook[str] = ConnectionBook(ApiLimits(max_connections=3, max_unauthenticated=3))
    for c in "abc":
        book.admit(c, 0.0)
    book.authenticated("a")
    book.authenticated("b")
    assert book.admit("d", 2.0) == (True, "c")  # all open: the unauthenticated one makes room
    book.authenticated("d")
    assert book.admit("e", 2.0) == (False, None)  # three with keys: nothing to push out
    assert book.open == {"a", "b", "d"}
    book.forget("a")
    assert book.admit("e", 2.0) == (True, None)


def test_the_throttle_reports_once_per_interval_with_the_count_left_out() -> None:
    throttle = Throttle(every_s=10.0)
    assert throttle.due(100.0) == 0
    assert [throttle.due(t) for t in (100.1, 101.0, 109.9)] == [None, None, None]
    assert throttle.due(110.0) == 3
    assert throttle.due(115.0) is None
    assert throttle.due(200.0) == 1
