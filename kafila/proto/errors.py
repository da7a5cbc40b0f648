"""The one error every wire-format parser in kafila.proto raises on bad input."""

from __future__ import annotations


class ProtocolError(ValueError):
    """Input that is not a valid message; the text says what is wrong and where.

    `code` is a short machine-readable reason ("bad_message", "too_large", "unsupported_version",
    ...) that signaling error replies carry unchanged. `ref`: the request reference the bad message
    carried, when it could be read, so the error reply reaches the request that waits for it.
    `version`: the protocol version an `unsupported_version` message claimed, to answer it in.
    """

    def __init__(self, message: str, code: str = "bad_message", ref: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.ref = ref
        self.version: int | None = None
