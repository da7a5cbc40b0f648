"""Tensor frames and session control messages: round trips and fuzzing of the decoder."""

from __future__ import annotations

import contextlib
import math
import struct
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.proto import tensor as t

u32 = st.integers(0, 2**32 - 1)
small = st.integers(0, 2**31 - 1)
tokens = st.lists(st.integers(0, 2**31 - 1), max_size=20).map(tuple)
text = st.text(max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def hiddens(draw: st.DrawFn) -> t.Hidden:
    dtype = draw(st.sampled_from(list(t.DType)))
    counts = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
    width = draw(st.integers(0, 8))
    entries = tuple(t.Entry(draw(u32), draw(u32), n) for n in counts)
    shape = (sum(counts), width)
    data = draw(st.binary(min_size=t.hidden_nbytes(dtype, shape), max_size=t.hidden_nbytes(dtype, shape)))
    timings = tuple(draw(st.lists(u32, max_size=5)))
    flags = draw(st.integers(0, 3))
    return t.Hidden(
        step=draw(u32), dtype=dtype, shape=shape, entries=entries, data=data, flags=flags, timings_us=timings
    )


messages = st.one_of(
    hiddens(),
    st.builds(t.FetchData, fetch_id=u32, data=st.binary(max_size=64)),
    st.builds(t.FetchRequest, fetch_id=small, file=text, offset=small, length=small),
    st.builds(
        t.Generate,
        request_id=small,
        prompt=tokens,
        max_tokens=small,
        temperature=finite.map(abs),
        top_k=small,
        top_p=st.floats(0, 1),
        seed=st.none() | st.integers(-(2**31), 2**31),
        stop=tokens,
        repeat_penalty=st.floats(0.01, 10),
        repeat_last_n=small,
        presence_penalty=st.floats(-2, 2),
        frequency_penalty=st.floats(-2, 2),
        min_p=st.floats(0, 1),
        carried=st.booleans(),
        generated=tokens,
    ),
    st.builds(
        t.Tokens,
        request_id=small,
        tokens=tokens,
        finish=st.none() | st.sampled_from(["stop", "length"]),
        queue_position=st.none() | small,
        prefill_s=st.none() | finite.map(abs),
    ),
    st.builds(t.Cancel, request_id=small, reason=text),
    st.builds(t.Error, request_id=small, code=text, message=text),
    st.builds(t.Control, op=text, body=st.dictionaries(text, st.integers() | text, max_size=4)),
)


@given(messages)
def test_every_message_round_trips(msg: t.Message) -> None:
    assert t.decode(t.encode(msg, 1)) == msg


@given(st.lists(messages, max_size=6), st.lists(st.integers(1, 50), min_size=1, max_size=10))
def test_reader_splits_a_stream_cut_anywhere(msgs: list[t.Message], cuts: list[int]) -> None:
    stream = b"".join(t.encode(m, 3) for m in msgs)
    reader, out, at, i = t.FrameReader(), [], 0, 0
    while at < len(stream):
        n = cuts[i % len(cuts)]
        out += reader.feed(stream[at : at + n])
        at, i = at + n, i + 1
    assert out == msgs
    assert reader.pending == 0


@settings(max_examples=400)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_frame_error(data: bytes) -> None:
    with contextlib.suppress(t.FrameError):
        t.decode(data)


@settings(max_examples=400)
@given(st.sampled_from(list(t.Kind)), st.binary(max_size=120))
def test_random_bodies_with_valid_prefix_decode_or_raise_frame_error(kind: t.Kind, body: bytes) -> None:
    with contextlib.suppress(t.FrameError):
        t.decode(struct.pack("<IBBI", len(body), t.VERSION, int(kind), 1) + body)


@settings(max_examples=200)
@given(messages, st.integers(0, 10_000), st.integers(0, 255))
def test_one_flipped_byte_decodes_or_raises_frame_error(msg: t.Message, where: int, value: int) -> None:
    data = bytearray(t.encode(msg, 1))
    data[where % len(data)] = value
    with contextlib.suppress(t.FrameError):
        t.decode(bytes(data))


def test_hidden_layout_is_the_documented_one() -> None:
    data = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    entries = (t.Entry(5, 9, 2),)
    msg = t.Hidden(
        step=7, dtype=t.DType.F32, shape=(2, 2), entries=entries, data=data, flags=3, timings_us=(42,)
    )
    record = t.encode(msg, 258)
    body_len, version, kind, epoch = struct.unpack_from("<IBBI", record)
    assert (version, kind, epoch, body_len) == (2, 1, 258, len(record) - 10)
    assert t.PREFIX_BYTES == 10
    assert struct.unpack_from("<HIBBHB", record, 10) == (3, 7, 1, 2, 1, 1)
    assert struct.unpack_from("<II", record, 10 + 11) == (2, 2)
    assert struct.unpack_from("<III", record, 10 + 19) == (5, 9, 2)
    assert struct.unpack_from("<I", record, 10 + 31) == (42,)
    assert record[-16:] == data


def test_hidden_with_wrong_byte_count_is_refused_with_the_numbers() -> None:
    msg = t.Hidden(step=0, dtype=t.DType.BF16, shape=(3, 4), entries=(t.Entry(1, 0, 3),), data=b"\0" * 10)
    with pytest.raises(t.FrameError, match=r"10 bytes, shape \(3, 4\) needs 24"):
        t.encode(msg, 1)


def test_entries_must_cover_the_rows() -> None:
    msg = t.Hidden(step=0, dtype=t.DType.F32, shape=(3, 1), entries=(t.Entry(1, 0, 2),), data=b"\0" * 12)
    with pytest.raises(t.FrameError, match="entries cover 2 rows, tensor has 3"):
        t.encode(msg, 1)


def test_bad_version_unknown_kind_and_bad_fields_are_named() -> None:
    good = t.encode(t.Cancel(request_id=3), 1)
    with pytest.raises(t.FrameError, match=r"unsupported version 9 \(this build speaks 2\)"):
        t.decode(good[:4] + b"\x09" + good[5:])
    with pytest.raises(t.FrameError, match=r"unsupported version 1 \(this build speaks 2\)"):
        t.decode(good[:4] + b"\x01" + good[5:])  # a version 1 record, as an older kafila sends
    with pytest.raises(t.FrameError, match="unknown message kind 99"):
        t.decode(good[:5] + b"\x63" + good[6:])
    body = b'{"request_id": -1}'
    with pytest.raises(t.FrameError, match=r"CANCEL.request_id is negative \(-1\)"):
        t.decode(struct.pack("<IBBI", len(body), 2, int(t.Kind.CANCEL), 1) + body)
    body = b'{"request_id": 1, "prompt": [1, "x"], "max_tokens": 3}'
    with pytest.raises(t.FrameError, match="list of token ids"):
        t.decode(struct.pack("<IBBI", len(body), 2, int(t.Kind.GENERATE), 1) + body)


def test_reader_refuses_a_huge_length_before_buffering_it() -> None:
    reader = t.FrameReader(max_body=1000)
    with pytest.raises(t.FrameError, match="exceeds the 1000-byte limit"):
        reader.feed(struct.pack("<IBBI", 5000, 2, 1, 1))


def test_itemsizes_match_dtype_names() -> None:
    assert t.hidden_nbytes(t.DType.BF16, (3, 5)) == 30
    assert t.hidden_nbytes(t.DType.F32, ()) == 4 * math.prod(())


def test_a_forwarded_request_carries_every_sampling_setting() -> None:
    """Sampling.forwarded and Sampling.of rely on Generate's fields after the prompt being
    Sampling's, in the same order: a field added to one and not the other fails here."""
    from dataclasses import fields

    from kafila.api.service import Sampling

    names = ["stop" if f.name == "stop_ids" else f.name for f in fields(Sampling)]
    assert [f.name for f in fields(t.Generate)][2 : 2 + len(names)] == names
    assert [f.name for f in fields(t.Generate)][2 + len(names) :] == ["carried", "generated", "asker"]
    s = Sampling(
        max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=-4, stop_ids=(5, 6), repeat_penalty=1.3,
        repeat_last_n=9, presence_penalty=0.2, frequency_penalty=-0.1, min_p=0.05,
    )  # fmt: skip
    msg = s.forwarded(12, [1, 2, 3])
    assert (msg.request_id, msg.prompt) == (12, (1, 2, 3))
    assert Sampling.of(t.decode(t.encode(msg, 1))) == s
    carried = t.decode(t.encode(replace(msg, carried=True, generated=(9, 8)), 1))
    assert isinstance(carried, t.Generate) and (carried.carried, carried.generated) == (True, (9, 8))
    assert Sampling.of(carried) == s
    plain = t.decode(t.encode(msg, 1))
    assert isinstance(plain, t.Generate) and (plain.carried, plain.generated) == (False, ())
