"""The pure authentication exchange: SPAKE2 on the secret, confirmations bound to the edge and TLS."""

from __future__ import annotations

import pytest

from kafila.net.auth import EdgeContext, LinkAuth
from kafila.net.errors import LinkAuthError

CTX = EdgeContext("S", "alice", "bob", b"code-secret")
FP = bytes(range(32))


def run(client: LinkAuth, server: LinkAuth) -> None:
    server.on_peer_hello(client.hello())
    client.on_peer_hello(server.hello())
    client.verify(server.confirm())
    server.verify(client.confirm())


def test_matching_views_authenticate() -> None:
    run(LinkAuth(CTX, True, FP), LinkAuth(CTX, False, FP))


def test_man_in_the_middle_certificate_is_detected_even_when_spake2_is_passed_through() -> None:
    # The client saw the interceptor's certificate; the server knows its own. SPAKE2 messages are
    # relayed unchanged (so both derive the same key), yet the confirmations must not match.
    with pytest.raises(LinkAuthError, match="did not prove"):
        run(LinkAuth(CTX, True, b"\x01" * 32), LinkAuth(CTX, False, FP))


def test_garbage_spake2_message_fails_closed() -> None:
    with pytest.raises(LinkAuthError, match="malformed"):
        LinkAuth(CTX, False, FP).on_peer_hello(b"\x00" * 5)


def test_confirm_before_hello_is_refused() -> None:
    with pytest.raises(LinkAuthError, match="before"):
        LinkAuth(CTX, True, FP).confirm()
