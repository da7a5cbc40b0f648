"""Exceptions a link raises: every failure surfaces as one of these, never as a hang."""

from __future__ import annotations


class LinkError(Exception):
    """Base of every link failure."""


class LinkClosed(LinkError):
    """The link is closed (by either side, or because its connection failed); the text says why."""


class LinkEnded(LinkClosed):
    """The peer closed the link because its person ended the session (the host stopped it)."""


class LinkTimeout(LinkError):
    """An operation on the link did not complete within its deadline (the text names it)."""


class LinkAuthError(LinkClosed):
    """The peer could not prove knowledge of the session secret for this edge: the link failed closed."""


class NatProbeError(Exception):
    """Classification could not reach the rendezvous's probe endpoints (the text says which)."""


class PeerSilent(LinkTimeout, LinkClosed):
    """Nothing arrived from the peer on any path for `peer_timeout`: the link is closed as dead."""
