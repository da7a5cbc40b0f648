"""The error a member's session start ends with: its message says at which step and why."""

from __future__ import annotations


class SessionError(RuntimeError):
    """Forming the session failed; the message says at which step and why."""


class HostLeft(SessionError):
    """The host left before this member was planned in (the rendezvous said so)."""


class NoHost(SessionError):
    """The session's code is known at the rendezvous, but no host holds it (its host was lost, and
    no successor has taken its place yet)."""
