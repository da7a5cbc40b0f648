"""The weight server's files (kafila.session.weights.server): each opened once, at its first range,
shared by ranges read on threads at once and closed with the server, while a file written or
replaced on disk (a GGUF served in place, or a plain safetensors file) is still refused at every
range. File descriptors are counted in /proc/self/fd (Linux)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from kafila.models.gguf_convert import convert
from kafila.models.weight_file import SourceChanged
from kafila.proto import tensor as t
from kafila.session.channel import MemoryChannel
from kafila.session.weights.manifest import WeightManifest
from kafila.session.weights.server import WeightServer
from tests.gguf_files import Shape, qwen3_tokenizer_meta, write_gguf
from tests.models.test_gguf import KQUANTS

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")

WEIGHTS = "model.safetensors"
RANGE = 1 << 12  # many ranges a tensor


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    """A Qwen3 file of the K-quants: kept types, and requantized ones made again at each range."""
    pytest.importorskip("gguf")
    meta = qwen3_tokenizer_meta(qwen3_tokenizer_dir)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen3.gguf", Shape(), meta, KQUANTS, tied=True)


@pytest.fixture
def inplace(gguf: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(the GGUF, a folder serving it in place), the GGUF a copy of the test's own to replace."""
    own = tmp_path / "model.gguf"
    shutil.copyfile(gguf, own)
    folder = tmp_path / "folder"
    folder.mkdir()
    convert(own, folder, progress=False, say=lambda line: None)
    assert not (folder / WEIGHTS).exists()
    return own, folder


def opened(path: Path) -> int:
    """How many of this process's file descriptors name `path`."""
    target, n = os.path.realpath(path), 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            n += os.readlink(f"/proc/self/fd/{fd}") == target
    return n


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def spans(m: WeightManifest, file: str = WEIGHTS) -> list[tuple[int, int]]:
    """Every byte of `file` the manifest offers, as ranges of at most RANGE bytes."""
    end = max(e.end for e in m.tensors.values() if e.file == file)
    return [(a, min(RANGE, end - a)) for a in range(0, end, RANGE)]


def tensors_intact(m: WeightManifest, data: dict[tuple[str, int], bytes]) -> None:
    """Each tensor's bytes among `data` (by file and offset) hash to the manifest's digest."""
    for e in m.tensors.values():
        got = b"".join(data[(e.file, a)] for a in range(e.start - e.start % RANGE, e.end, RANGE))
        skip = e.start % RANGE
        assert hashlib.sha256(got[skip : skip + e.nbytes]).hexdigest() == e.sha256, e.name


def replace_keeping_size_and_mtime(path: Path, data: bytes) -> None:
    """`data` put in `path`'s place by a rename (a new inode), with the size and mtime it had."""
    st = path.stat()
    assert len(data) == st.st_size
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, path)


async def test_a_gguf_served_in_place_is_opened_once_for_all_its_ranges_and_closed_with_the_server(
    inplace: tuple[Path, Path], tmp_path: Path
) -> None:
    gguf, folder = inplace
    server = WeightServer(folder, max_request=RANGE, cache=tmp_path / "host")
    m = await server.prepare()
    assert opened(gguf) == 0
    ranges = spans(m)
    assert len(ranges) > 100
    data = {(WEIGHTS, a): server.read_range(WEIGHTS, a, n) for a, n in ranges[:1]}
    fds, held = descriptors(), opened(gguf)
    assert held in (1, 2)  # opened at the first range, and kept (its map may hold a second descriptor)
    for a, n in ranges[1:]:
        data[(WEIGHTS, a)] = server.read_range(WEIGHTS, a, n)
        assert descriptors() == fds
    assert opened(gguf) == held
    tensors_intact(m, data)
    server.close()
    assert opened(gguf) == 0 and descriptors() == fds - held
    assert server.read_range(WEIGHTS, *ranges[-1]) == data[(WEIGHTS, ranges[-1][0])]  # opened again
    server.close()
    assert opened(gguf) == 0


async def test_a_plain_checkpoints_files_are_each_opened_once(tiny_checkpoint, tmp_path: Path) -> None:
    """(Counted against what the process held before: the fixture's folder is shared with other
    tests, whose loaded models may still map its files.)"""
    folder = tiny_checkpoint("llama-mha-untied", sharded=True)
    files = sorted(p for p in folder.glob("*.safetensors"))
    assert len(files) > 1
    before = [opened(f) for f in files]
    server = WeightServer(folder, max_request=RANGE, cache=tmp_path / "host")
    m = await server.prepare()
    data = {}
    for f, had in zip(files, before, strict=True):
        for a, n in spans(m, f.name):
            data[(f.name, a)] = server.read_range(f.name, a, n)
        assert opened(f) == had + 1
    assert [opened(f) for f in files] == [had + 1 for had in before]
    tensors_intact(m, data)
    server.close()
    assert [opened(f) for f in files] == before


async def test_ranges_read_on_threads_at_once_share_the_file_and_survive_a_close(
    inplace: tuple[Path, Path], tmp_path: Path
) -> None:
    """As members' fetches are answered (asyncio.to_thread each): every range's bytes right, one
    opening of the GGUF among them all, and a close meanwhile closes nothing a read is using."""
    gguf, folder = inplace
    server = WeightServer(folder, max_request=RANGE, cache=tmp_path / "host")
    m = await server.prepare()
    ranges = spans(m)
    server.read_range(WEIGHTS, *ranges[0])
    held = opened(gguf)
    assert held > 0
    fds_seen: list[int] = []

    def read(a: int, n: int) -> bytes:
        out = server.read_range(WEIGHTS, a, n)
        fds_seen.append(opened(gguf))
        return out

    got = await asyncio.gather(*(asyncio.to_thread(read, a, n) for a, n in ranges))
    assert set(fds_seen) == {held}
    data = {(WEIGHTS, a): b for (a, _), b in zip(ranges, got, strict=True)}
    tensors_intact(m, data)
    closing = [asyncio.to_thread(read, a, n) for a, n in ranges[:64]]
    closing.insert(32, asyncio.to_thread(server.close))
    again = await asyncio.gather(*closing)
    del again[32]
    assert again == [data[(WEIGHTS, a)] for a, _ in ranges[:64]]
    server.close()
    assert opened(gguf) == 0


async def test_a_gguf_replaced_after_the_first_range_is_refused_naming_it_at_every_range(
    inplace: tuple[Path, Path], tmp_path: Path
) -> None:
    """The GGUF put back by another of its size and mtime (only its inode differs): the server's
    open map still holds the old one, but no range is served; a member hears the sentence naming
    the GGUF. Removed, it is refused as gone."""
    gguf, folder = inplace
    server = WeightServer(folder, max_request=RANGE, cache=tmp_path / "host")
    m = await server.prepare()
    (a, n), later = spans(m)[0], spans(m)[-1]
    server.read_range(WEIGHTS, a, n)
    replace_keeping_size_and_mtime(gguf, gguf.read_bytes()[::-1])
    for _ in range(2):
        with pytest.raises(SourceChanged, match=f"the GGUF {gguf}, which changed since it was converted"):
            server.read_range(WEIGHTS, *later)
    host_end, member_end = MemoryChannel.pair("host", "m1")
    assert await server.handle(host_end, t.FetchRequest(7, WEIGHTS, *later))
    said = await member_end.recv(5)
    assert isinstance(said, t.Error) and said.code == "fetch_failed" and said.request_id == 7
    assert f"its weights are the GGUF {gguf}, which changed since it was converted" in said.message
    gguf.unlink()
    with pytest.raises(SourceChanged, match=f"the GGUF {gguf}, which is gone"):
        server.read_range(WEIGHTS, a, n)
    server.close()


async def test_a_plain_file_replaced_after_the_first_range_is_refused(
    tiny_checkpoint, tmp_path: Path
) -> None:
    """A safetensors file put in place of the one described, of its size and mtime (only the inode
    differs): the server's open descriptor reads the old one, but what the path names is refused."""
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama-mha-untied", sharded=True), copy)
    server = WeightServer(copy, max_request=RANGE, cache=tmp_path / "host")
    m = await server.prepare()
    file = next(iter(m.headers))
    (a, n), later = spans(m, file)[0], spans(m, file)[-1]
    server.read_range(file, a, n)
    raw = (copy / file).read_bytes()
    replace_keeping_size_and_mtime(copy / file, raw[: m.headers[file]] + bytes(len(raw) - m.headers[file]))
    with pytest.raises(OSError, match="the file changed on the host after the session described it"):
        server.read_range(file, *later)
    server.close()
