from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kafila.net.framing import MAX_MESSAGE_BYTES, FramingError, MessageReader, encode_header


@given(
    st.lists(st.tuples(st.integers(0, 0xFFFF), st.binary(max_size=300)), max_size=8),
    st.integers(1, 50),
)
def test_messages_survive_any_chunking(messages: list[tuple[int, bytes]], chunk: int) -> None:
    wire = b"".join(encode_header(k, len(p)) + p for k, p in messages)
    reader = MessageReader()
    got = []
    for i in range(0, len(wire), chunk):
        got += reader.feed(wire[i : i + chunk])
    assert got == messages and reader.pending_bytes == 0


def test_oversized_announcement_is_refused() -> None:
    with pytest.raises(FramingError, match=str(MAX_MESSAGE_BYTES)):
        MessageReader().feed((16).to_bytes(2, "big") + (MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(FramingError, match="kind"):
        encode_header(70000, 1)
