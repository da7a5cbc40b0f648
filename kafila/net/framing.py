"""Messages on a link's QUIC stream: a 6-byte header (kind:u16, length:u32) then the payload.

Pure: `encode_header` builds a header, `MessageReader` turns stream bytes into (kind, payload).
Kinds below `FIRST_APP_KIND` belong to the link itself (authentication); the session layer uses
the rest.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("!HI")
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a tensor frame of a large model's prefill fits easily
FIRST_APP_KIND = 16
KIND_AUTH_HELLO = 1  # SPAKE2 message
KIND_AUTH_CONFIRM = 2  # key confirmation MAC


class FramingError(ValueError):
    pass


def encode_header(kind: int, length: int) -> bytes:
    if not 0 <= kind <= 0xFFFF:
        raise FramingError(f"message kind {kind} outside 0..65535")
    if length > MAX_MESSAGE_BYTES:
        raise FramingError(f"message of {length} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    return HEADER.pack(kind, length)


class MessageReader:
    """Accumulates stream bytes and yields complete messages in order."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buf += data
        out: list[tuple[int, bytes]] = []
        while len(self._buf) >= HEADER.size:
            kind, length = HEADER.unpack_from(self._buf)
            if length > MAX_MESSAGE_BYTES:
                raise FramingError(f"peer announced a {length}-byte message, limit {MAX_MESSAGE_BYTES}")
            end = HEADER.size + length
            if len(self._buf) < end:
                break
            out.append((kind, bytes(self._buf[HEADER.size : end])))
            del self._buf[:end]
        return out

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)
