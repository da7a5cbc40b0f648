"""The error a member's session start ends with: its message says at which step and why."""

from __future__ import annotations


class SessionError(RuntimeError):
    """Forming the session failed; the message says at which step and why."""
