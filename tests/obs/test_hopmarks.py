"""Hop marks (kafila.obs.hopmarks): off by default; on, a frame sent over a real loopback QUIC
link leaves its send, encoded, sent, read and decoded marks in time order on one clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafila.net.auth import EdgeContext
from kafila.obs import hopmarks
from kafila.proto import tensor as t
from kafila.session.channel import LinkChannel, send_marked
from tests.net.conftest import direct_pair


def frame(rid: int, position: int) -> t.Hidden:
    return t.Hidden(0, t.DType.F32, (1, 4), (t.Entry(rid, position, 1),), bytes(16), 0, (5,))


def read_marks(folder: Path) -> dict[str, int]:
    lines = [ln.split() for f in folder.glob("*.marks") for ln in f.read_text().splitlines()]
    return {tag: int(ns) for tag, _key, ns in lines if _key == "7:3:1"}


def test_marks_are_off_unless_a_folder_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hopmarks, "FOLDER", None)
    hopmarks.mark("start", frame(7, 3).entries)
    hopmarks.flush()
    monkeypatch.setattr(hopmarks, "FOLDER", str(tmp_path))
    hopmarks.flush()
    assert list(tmp_path.iterdir()) == []


def test_a_mark_names_the_frames_first_entry_and_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hopmarks, "FOLDER", str(tmp_path))
    hopmarks.mark("start", frame(7, 3).entries)
    hopmarks.mark("read", frame(7, 3).entries, ns=123)
    hopmarks.mark("start", ())  # a message without rows (a control) leaves no mark
    hopmarks.flush()
    (only,) = tmp_path.glob("*.marks")
    tags = [ln.split() for ln in only.read_text().splitlines()]
    assert [(tag, key) for tag, key, _ in tags] == [("start", "7:3:1"), ("read", "7:3:1")]
    assert int(tags[1][2]) == 123


async def test_a_frame_over_a_loopback_link_is_marked_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hopmarks, "FOLDER", str(tmp_path))
    ctx = EdgeContext("S-marks", "alice", "bob", b"correct horse")
    client, server, a, b = await direct_pair(ctx, ctx)
    try:
        await client.wait_ready()
        await server.wait_ready()
        sender, receiver = LinkChannel(client, "bob"), LinkChannel(server, "alice")
        await send_marked(sender, frame(7, 3))
        assert await receiver.recv(5.0) == frame(7, 3)
        await send_marked(sender, t.Control("beat"))  # not a frame: no marks
        assert await receiver.recv(5.0) == t.Control("beat")
    finally:
        await client.close()
        await server.close()
        a.close()
        b.close()
    hopmarks.flush()
    marks = read_marks(tmp_path)
    order = ["send", "encoded", "sent", "read", "decoded"]
    assert sorted(marks) == sorted(order)
    assert [marks[tag] for tag in order] == sorted(marks.values())
