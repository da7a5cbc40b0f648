"""A spare's relayed requests (kafila.api.asks, pure): numbered, each answer followed from its
reply to its last chunk, dropped when the client leaves, and failed with a true message once the
control link to the host is gone, after which nothing more is taken."""

from __future__ import annotations

import pytest

from kafila.api.asks import Asks, Body, Failed, Started, Unreachable, answer_headers, asked_headers
from kafila.proto import session as sm

JSON = (("Content-Type", "application/json"), ("Authorization", "Bearer k"), ("Accept", "*/*"))


def test_an_answer_goes_from_its_reply_to_its_last_chunk() -> None:
    asks = Asks("host")
    one = asks.ask("POST", "/v1/chat/completions", "", JSON, b"{}")
    two = asks.ask("GET", "/v1/models", "", (), b"")
    assert (one.ask, two.ask) == (1, 2)
    assert one.headers == (("content-type", "application/json"), ("accept", "*/*"))  # no key travels
    assert asks.heard(sm.Chunk(1, b"early")) == []  # a chunk before its reply is out of turn
    assert asks.heard(sm.Reply(1, 429, (("retry-after", "1"), ("content-length", "9")))) == [
        Started(1, 429, (("retry-after", "1"),))
    ]
    assert asks.heard(sm.Reply(1, 200)) == []  # a second reply
    assert asks.heard(sm.Chunk(1, b"a")) == [Body(1, b"a", False)]
    assert asks.heard(sm.Chunk(1, b"b", True)) == [Body(1, b"b", True)]
    assert asks.heard(sm.Chunk(1, b"late")) == []  # answered: closed
    assert asks.heard(sm.Reply(7, 200)) == []  # never asked
    assert set(asks.open) == {2}


def test_a_client_that_leaves_drops_its_request_once() -> None:
    asks = Asks("host")
    ask = asks.ask("POST", "/api/chat", "", (), b"{}")
    assert asks.drop(ask.ask) == sm.Drop(ask.ask)
    assert asks.drop(ask.ask) is None
    assert asks.heard(sm.Reply(ask.ask, 200)) == []  # what was on its way is dropped


def test_a_link_lost_fails_every_open_request_and_refuses_new_ones_naming_the_host() -> None:
    asks = Asks("m0")
    asks.ask("POST", "/v1/completions", "", (), b"{}")
    answering = asks.ask("POST", "/api/generate", "", (), b"{}").ask
    asks.heard(sm.Reply(answering, 200))
    failed = asks.lost("link to 7: the peer closed it")
    assert [(f.ask, f.started) for f in failed] == [(1, False), (2, True)]
    assert all("control link to the host is gone (link to 7: the peer closed it)" in f.reason for f in failed)
    assert all(isinstance(f, Failed) and "to the host m0" in f.reason for f in failed)
    assert asks.lost("again") == [] and asks.gone == "link to 7: the peer closed it"  # the first reason stays
    with pytest.raises(Unreachable, match="spare and relays its requests to the host m0"):
        asks.ask("GET", "/v1/models", "", (), b"")
    assert asks.drop(answering) is None  # nothing to tell a host no longer reachable


def test_a_body_past_what_a_spare_relays_is_refused_and_ids_wrap() -> None:
    asks = Asks("host")
    with pytest.raises(ValueError, match=f"more than the {sm.MAX_ASK_BODY}"):
        asks.ask("POST", "/api/chat", "", (), b"x" * (sm.MAX_ASK_BODY + 1))
    asks._last = sm.MAX_ASK
    assert asks.ask("GET", "/", "", (), b"").ask == 1


def test_headers_that_travel() -> None:
    assert asked_headers([("Host", "x"), ("X-Api-Key", "k"), ("CONTENT-TYPE", "a/b")]) == (
        ("content-type", "a/b"),
    )
    assert answer_headers([("Content-Length", "3"), ("Retry-After", "3"), ("Content-Type", "t")]) == (
        ("retry-after", "3"),
        ("content-type", "t"),
    )
