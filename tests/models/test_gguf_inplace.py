"""A GGUF served in place (kafila.models.gguf_inplace): an Ollama store's blob (and any GGUF file)
converts to a folder with no tensor bytes in it, whose `model.safetensors` is made from the blob
when read, byte for byte the copy's, and refused once the blob changed or is gone."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kafila.models import ollama
from kafila.models.checkpoint import Checkpoint, CheckpointError, open_weights
from kafila.models.gguf_convert import convert, ensure_gguf
from kafila.models.registry import resolve
from kafila.models.weight_file import SourceChanged, inplace_index
from kafila.session.channel import MemoryChannel
from kafila.session.weights.fetch import fetch_shard
from kafila.session.weights.manifest import checkpoint_id, describe
from kafila.session.weights.server import WeightServer
from tests.gguf_files import Shape, greedy_ids, qwen3_tokenizer_meta, write_gguf
from tests.models.test_gguf import KQUANTS, MIXED
from tests.models.test_ollama import _blob, _manifest

pytest.importorskip("gguf")
PROMPT = [9707, 11, 1879, 0, 3555, 374, 279, 6722, 315, 9625, 30]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> dict[str, Path]:
    """A Qwen3 file of the K-quants (kept, scaled and requantized types) and a Llama file of mixed
    types with an untied head (its q/k rows permuted by llama.cpp's converter, put back)."""
    folder = tmp_path_factory.mktemp("gguf-inplace")
    meta = qwen3_tokenizer_meta(qwen3_tokenizer_dir)
    return {
        "kquant": write_gguf(folder / "tiny-qwen3-kquants.gguf", Shape(), meta, KQUANTS, tied=True),
        "llama": write_gguf(folder / "tiny-llama-mixed.gguf", Shape(arch="llama"), meta, MIXED, tied=False),
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, ggufs: dict[str, Path], cache: Path) -> Iterator[Path]:
    """An Ollama store (as tests.models.test_ollama lays one out) holding both files as blobs."""
    root = tmp_path_factory.mktemp("ollama") / "models"
    for name, file in ggufs.items():
        _manifest(root, "library", name, "latest", [{"mediaType": ollama.MODEL_LAYER, **_blob(root, file)}])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OLLAMA_MODELS", str(root))
        yield root


@pytest.fixture(scope="module")
def copies(ggufs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each file converted the way it was before: model.safetensors written out (the copy)."""
    out = {}
    for name, file in ggufs.items():
        folder = tmp_path_factory.mktemp(f"copy-{name}")
        convert(file, folder, progress=False, say=lambda line: None, inplace=False)
        out[name] = folder
    return out


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize("name", ["kquant", "llama"])
def test_an_ollama_blob_converts_to_a_folder_without_its_tensor_bytes(
    store: Path, cache: Path, copies: dict[str, Path], name: str
) -> None:
    blob = ollama.locate(f"ollama:{name}").model
    folder = resolve(f"ollama:{name}", progress=False)
    weights = folder / "model.safetensors"
    assert not weights.exists() and inplace_index(weights).is_file()
    ckpt = Checkpoint.open(folder, complete=True)
    data = sum(t.nbytes for t in ckpt.tensors.values())
    small = _bytes(folder) - (folder / "tokenizer.json").stat().st_size  # the tokenizer is the vocabulary
    # the copy held every tensor (about the blob's bytes, more where K-quants widen their scales);
    # in place the folder holds the index: the header and a few hundred bytes a tensor
    assert (copies[name] / "model.safetensors").stat().st_size > data > blob.stat().st_size // 2
    header = min(t.start for t in ckpt.tensors.values())
    assert inplace_index(weights).stat().st_size < header + 400 * len(ckpt.tensors)
    assert small < blob.stat().st_size // 100
    assert _bytes(cache / "gguf") < blob.stat().st_size  # and no copy elsewhere in the cache


@pytest.mark.parametrize("name", ["kquant", "llama"])
def test_in_place_bytes_are_the_copys_byte_for_byte_in_any_ranges(
    store: Path, copies: dict[str, Path], name: str
) -> None:
    folder = resolve(f"ollama:{name}", progress=False)
    want = (copies[name] / "model.safetensors").read_bytes()
    with open_weights(folder / "model.safetensors") as f:
        assert f.size() == len(want)
        at, step = 0, 777_777  # ranges that cut tensors, rows and headers anywhere
        while at < len(want):
            assert f.pread(at, step) == want[at : at + step], f"bytes [{at}, {at + step})"
            at += step
        assert f.pread(len(want) - 3, 10) == want[-3:]  # short at the end, as a file is
        digests = f.digests()
    ours, theirs = Checkpoint.open(folder, complete=True), Checkpoint.open(copies[name], complete=True)
    assert {n: (t.dtype, t.shape, t.start, t.end) for n, t in ours.tensors.items()} == {
        n: (t.dtype, t.shape, t.start, t.end) for n, t in theirs.tensors.items()
    }
    assert digests == {
        n: hashlib.sha256(want[t.start : t.end]).hexdigest() for n, t in theirs.tensors.items()
    }
    assert checkpoint_id(folder) == checkpoint_id(copies[name])
    # the host's manifest (what members fetch and the planner prices) is the copy's
    assert (
        describe(folder, cache=folder.parent / "hashes").tensors
        == describe(copies[name], cache=folder.parent / "hashes").tensors
    )


def _greedy(folder: Path, n: int) -> list[int]:
    return greedy_ids(folder, PROMPT, n)


@pytest.mark.parametrize("name", ["kquant", "llama"])
def test_a_stage_loads_the_copys_tensors_and_answers_its_greedy_tokens(
    store: Path, copies: dict[str, Path], name: str
) -> None:
    folder = resolve(f"ollama:{name}", progress=False)
    ours, theirs = Checkpoint.open(folder), Checkpoint.open(copies[name])
    names = list(theirs.tensors)
    got, want = ours.read(names), theirs.read(names)
    assert all(got[n][1] == want[n][1] for n in names)
    assert ours.bytes_read == theirs.bytes_read
    # one read a tensor, as a stage loads (a matrix's scales and mins come from its weight's making)
    assert all(ours.read([n])[n][1] == want[n][1] for n in reversed(names))
    assert all(ours.read([n])[n][1] == want[n][1] for n in names)
    assert _greedy(folder, 6) == _greedy(copies[name], 6)


async def test_the_weight_server_serves_the_copys_bytes_from_the_blob(
    store: Path, copies: dict[str, Path], tmp_path: Path
) -> None:
    folder = resolve("ollama:kquant", progress=False)
    server = WeightServer(folder, max_request=1 << 20, cache=tmp_path)
    m = await server.prepare()
    want = (copies["kquant"] / "model.safetensors").read_bytes()
    assert m.headers["model.safetensors"] < len(want)
    for e in m.tensors.values():  # each tensor as a fetching member asks for it: max_request at a time
        got = b"".join(
            server.read_range("model.safetensors", a, min(m.max_request, e.end - a))
            for a in range(e.start, e.end, m.max_request)
        )
        assert (
            hashlib.sha256(got).hexdigest() == e.sha256 == hashlib.sha256(want[e.start : e.end]).hexdigest()
        )


def test_a_changed_or_removed_blob_is_refused_naming_it(
    ggufs: dict[str, Path], cache: Path, tmp_path: Path
) -> None:
    blob = tmp_path / "blobs" / "sha256-0123"
    blob.parent.mkdir()
    shutil.copyfile(ggufs["kquant"], blob)
    folder = ensure_gguf(blob, progress=False, say=lambda line: None)
    ckpt = Checkpoint.open(folder, complete=True)
    name = next(iter(ckpt.tensors))
    before = ckpt.read([name])[name][1]
    st = blob.stat()  # Ollama pulled a new version over it (a new mtime: file times can be coarse)
    with open(blob, "r+b") as f:
        f.seek(st.st_size - 64)
        f.write(bytes(64))
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(CheckpointError, match=f"its weights are the GGUF {blob}, which changed"):
        ckpt.read([name])
    with pytest.raises(CheckpointError, match=f"{blob}, which changed since it was converted"):
        Checkpoint.open(folder)
    with pytest.raises(SourceChanged, match="refusing its bytes"):
        open_weights(folder / "model.safetensors")
    again = ensure_gguf(blob, progress=False, say=lambda line: None)  # run again: converted anew
    assert again != folder and len(Checkpoint.open(again, complete=True).read([name])[name][1]) == len(before)
    blob.unlink()  # `ollama rm`
    with pytest.raises(CheckpointError, match=f"the GGUF {blob}, which is gone"):
        Checkpoint.open(again)


async def test_a_blob_changed_while_the_host_serves_is_not_served(
    ggufs: dict[str, Path], cache: Path, tmp_path: Path
) -> None:
    blob = tmp_path / "model.gguf"
    shutil.copyfile(ggufs["kquant"], blob)
    server = WeightServer(ensure_gguf(blob, progress=False, say=lambda line: None), cache=tmp_path / "host")
    m = await server.prepare()
    e = min(m.tensors.values(), key=lambda e: e.nbytes)
    assert hashlib.sha256(server.read_range("model.safetensors", e.start, e.nbytes)).hexdigest() == e.sha256
    blob.unlink()
    with pytest.raises(OSError, match=f"the GGUF {blob}, which is gone"):
        server.read_range("model.safetensors", e.start, e.nbytes)


async def test_a_member_fetches_its_shard_from_a_host_serving_in_place(
    store: Path, copies: dict[str, Path], tmp_path: Path
) -> None:
    """A member's share fetched over a session channel from a host serving the blob in place: the
    copy's checkpoint id and tensor bytes, every digest checked by the member on the way."""
    folder = resolve("ollama:llama", progress=False)
    server = WeightServer(folder, max_request=1 << 16, cache=tmp_path / "host")  # many requests a tensor
    host_end, member_end = MemoryChannel.pair("host", "m1")
    serving = asyncio.ensure_future(server.serve(host_end, timeout=30))
    got = await fetch_shard(member_end, range(1, 2), True, cache=tmp_path / "m1", local=[], progress=False)
    await asyncio.wait_for(serving, 10)
    copy = Checkpoint.open(copies["llama"])
    names = copy.names_for(range(1, 2), True)
    assert got.checkpoint == checkpoint_id(copies["llama"]) and sorted(got.fetched) == sorted(names)
    assert got.tensor_bytes == sum(copy.tensors[n].nbytes for n in names)
    shard, want = Checkpoint.open(got.path).read(names), copy.read(names)
    assert all(shard[n][1] == want[n][1] for n in names)
