"""Plan epochs on ring records: a channel's gate keeps its own epoch's messages and drops the others'."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.proto import tensor as t
from kafila.proto.epoch import EpochGate, Stale
from tests.proto.test_tensor_frames import messages

epochs = st.integers(1, t.MAX_EPOCH)
HIDDEN = t.Hidden(step=4, dtype=t.DType.F32, shape=(1, 2), entries=(t.Entry(7, 3, 1),), data=b"\0" * 8)


def test_a_record_of_the_gates_epoch_is_kept() -> None:
    gate = EpochGate(2)
    assert gate.admit(gate.stamp(HIDDEN)) == HIDDEN
    assert gate.dropped == {}


def test_an_older_epochs_frames_are_dropped_counted_and_flagged_once() -> None:
    old, new = EpochGate(1), EpochGate(2)
    record = old.stamp(HIDDEN)
    first, second = new.admit(record), new.admit(record)
    assert first == Stale(epoch=1, kind=int(t.Kind.HIDDEN), size=len(record), first=True)
    assert isinstance(second, Stale) and not second.first  # one log event per stale epoch, not per frame
    assert new.dropped == {1: 2} and new.total_dropped == 2
    assert "a frame of epoch 1 (kind 1" in first.describe(2) and "channel of epoch 2" in first.describe(2)
    third = new.admit(EpochGate(3).stamp(t.Control("beat")))  # a newer epoch is not this channel's either
    assert isinstance(third, Stale) and third.first and new.dropped == {1: 2, 3: 1}
    assert new.admit(new.stamp(HIDDEN)) == HIDDEN  # the current epoch still passes after drops


def test_a_stale_record_is_dropped_without_decoding_its_body() -> None:
    """An old epoch's frame is never decoded, let alone computed: even a body no decoder accepts."""
    body = b"short"
    record = struct.pack("<IBBI", len(body), t.VERSION, int(t.Kind.HIDDEN), 1) + body
    assert EpochGate(2).admit(record) == Stale(1, int(t.Kind.HIDDEN), len(record), True)
    with pytest.raises(t.FrameError, match="HIDDEN body of 5 bytes is shorter"):
        EpochGate(1).admit(record)  # of the current epoch, the same bytes are refused as they are


def test_garbage_is_refused_clearly_whatever_its_epoch() -> None:
    gate = EpochGate(1)
    with pytest.raises(t.FrameError, match="record of 3 bytes is shorter than the 10-byte prefix"):
        gate.admit(b"abc")
    good = EpochGate(5).stamp(t.Cancel(3))
    with pytest.raises(t.FrameError, match=r"length prefix says \d+ bytes, record holds"):
        gate.admit(good + b"x")
    with pytest.raises(t.FrameError, match=r"unsupported version 1 \(this build speaks 2\)"):
        gate.admit(good[:4] + b"\x01" + good[5:])
    assert gate.dropped == {}  # refused, not counted as stale


@pytest.mark.parametrize("bad", [0, -1, 2**32, True])
def test_a_gate_takes_only_a_plan_epoch(bad: int) -> None:
    with pytest.raises(ValueError, match=r"a plan epoch is 1\.\.4294967295, got"):
        EpochGate(bad)


def test_encode_refuses_an_epoch_the_prefix_cannot_hold() -> None:
    with pytest.raises(t.FrameError, match=r"epoch 4294967296 is outside 0\.\.4294967295"):
        t.encode(HIDDEN, 2**32)


@given(messages, epochs, epochs)
def test_a_message_passes_exactly_when_the_epochs_match(msg: t.Message, sent: int, own: int) -> None:
    record = EpochGate(sent).stamp(msg)
    assert t.header(record).epoch == sent
    out = EpochGate(own).admit(record)
    if sent == own:
        assert out == msg
    else:
        assert out == Stale(sent, int(msg.kind), len(record), True)


@settings(max_examples=300)
@given(messages, epochs, st.integers(0, 10_000), st.integers(0, 255))
def test_a_flipped_byte_gives_the_message_a_stale_verdict_or_frame_error(
    msg: t.Message, own: int, where: int, value: int
) -> None:
    data = bytearray(EpochGate(own).stamp(msg))
    data[where % len(data)] = value
    with contextlib.suppress(t.FrameError):
        out = EpochGate(own).admit(bytes(data))
        assert isinstance(out, Stale) == (t.header(data).epoch != own)


@settings(max_examples=300)
@given(st.binary(max_size=64), epochs)
def test_random_bytes_are_a_message_a_stale_verdict_or_frame_error(data: bytes, own: int) -> None:
    with contextlib.suppress(t.FrameError):
        EpochGate(own).admit(data)
