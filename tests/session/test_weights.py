"""Per-shard weight fetch (kafila.session.weights.fetch) over in-memory channels and real QUIC links on
loopback: exact shares, the cache, local copies, refusals and damaged responses."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest

from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint, read_header
from kafila.planner.plan import Plan
from kafila.planner.plan import Stage as PlanStage
from kafila.proto import tensor as t
from kafila.session.channel import Channel, LinkChannel, MemoryChannel
from kafila.session.forming.join import weights_source
from kafila.session.weights.cache import BlobStore, file_stamp
from kafila.session.weights.fetch import ShardResult, fetch_for_plan, fetch_shard
from kafila.session.weights.manifest import WeightsError
from kafila.session.weights.server import WeightServer

MODEL = "llama-mha-untied"  # untied lm_head: the head's share has three head tensors
SPLITS = {"m0": (0, 2), "m1": (2, 4), "m2": (4, 5)}


def three_member_plan() -> Plan:
    stages = tuple(PlanStage(n, a, b, n == "m0", None, 0, 0) for n, (a, b) in SPLITS.items())
    return Plan("kafila", True, None, "working_set", "test", tuple(SPLITS), "m0", stages, (), 5, 64, 1)


@pytest.fixture(scope="module")
def folder(tiny_checkpoint) -> Path:
    return tiny_checkpoint(MODEL, sharded=True)  # several safetensors files


@pytest.fixture(scope="module")
def full(folder: Path) -> Checkpoint:
    return Checkpoint.open(folder)


Pair = Callable[[str], "asyncio.Future[tuple[Channel, Channel]]"]


@pytest.fixture(params=["memory", pytest.param("quic", marks=pytest.mark.network)])
async def pairs(request) -> AsyncIterator[Callable[[str], object]]:
    """Makes (member end, host end) channels: in memory, or over a real authenticated QUIC link."""
    cleanup: list[object] = []

    async def make(name: str) -> tuple[Channel, Channel]:
        if request.param == "memory":
            host_end, member_end = MemoryChannel.pair("host", name)
            return member_end, host_end
        from kafila.net.auth import EdgeContext
        from tests.net.conftest import direct_pair

        ctx = EdgeContext("S-weights", name, "host", b"correct horse")
        client, server, a, b = await direct_pair(ctx, ctx)
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        cleanup.append((client, server, a, b))
        return LinkChannel(client, "host"), LinkChannel(server, name)

    yield make
    for client, server, a, b in cleanup:  # type: ignore[misc]
        await client.close()
        await server.close()
        a.close()
        b.close()


async def fetch_via(
    server: WeightServer, member: Channel, host: Channel, blocks: range, head: bool, cache: Path, **kw
) -> ShardResult:
    serving = asyncio.ensure_future(server.serve(host, timeout=30))
    try:
        return await fetch_shard(member, blocks, head, cache=cache, local=[], **{"progress": False, **kw})
    finally:
        await asyncio.wait_for(serving, 10)


def share(full: Checkpoint, blocks: range, head: bool) -> tuple[list[str], int]:
    names = full.names_for(blocks, head)
    return names, sum(full.tensors[n].nbytes for n in names)


def chained_logits(stages: list[Stage], ids: list[int]) -> np.ndarray:
    h = stages[0].embed(ids)
    for s in stages:
        s.open("r")
        [h] = s.forward([("r", 0, h)])
    return stages[0].logits(h[-1])


def load(ckpt: Checkpoint, blocks: range, head: bool) -> Stage:
    return Stage.load(ckpt, blocks, head, backend="torch", dtype="fp32", context=32)


async def test_three_members_fetch_exactly_their_share_and_load(pairs, folder, full, tmp_path) -> None:
    plan = three_member_plan()
    server = WeightServer(folder, max_request=4096, cache=tmp_path / "host")  # many requests per tensor
    results: dict[str, ShardResult] = {}
    host_ends: dict[str, Channel] = {}
    for name in plan.order:
        member, host = await pairs(name)
        host_ends[name] = host
        serving = asyncio.ensure_future(server.serve(host, timeout=30))
        results[name] = await fetch_for_plan(
            member, plan, name, cache=tmp_path / name, local=[], progress=False, window=4
        )
        await asyncio.wait_for(serving, 10)
    for name in plan.order:
        a, b = plan.block_range(name)
        names, nbytes = share(full, range(a, b), plan.stage(name).head)
        r = results[name]
        assert sorted(r.fetched) == sorted(names) and r.tensor_bytes == nbytes, name
        assert server.stats[name].bytes_sent == r.tensor_bytes + r.meta_bytes
        assert not r.local
        shard = Checkpoint.open(r.path)
        assert set(shard.tensors) == set(names)  # exactly the share, nothing more
    assert sum(r.tensor_bytes for r in results.values()) == sum(i.nbytes for i in full.tensors.values())
    ids = [5, 9, 1, 77, 3, 18]
    fetched = [load(Checkpoint.open(results[n].path), range(*SPLITS[n]), n == "m0") for n in plan.order]
    reference = [load(full, range(*SPLITS[n]), n == "m0") for n in plan.order]
    got, want = chained_logits(fetched, ids), chained_logits(reference, ids)
    assert got.shape == (full.config.vocab_size,)
    np.testing.assert_array_equal(got, want)


async def test_restart_fetches_nothing_and_replan_fetches_only_the_moved_block(
    folder, full, tmp_path, capsys
) -> None:
    server = WeightServer(folder, cache=tmp_path / "host")
    cache = tmp_path / "member"
    first = await fetch_via(server, *MemoryChannel.pair("host", "m1")[::-1], range(2, 4), False, cache)
    assert first.tensor_bytes == share(full, range(2, 4), False)[1] and first.meta_bytes > 0
    inode = first.path.stat().st_ino
    again = await fetch_via(server, *MemoryChannel.pair("host", "m1")[::-1], range(2, 4), False, cache)
    assert again.bytes_fetched == 0 and again.fetched == () and again.path == first.path
    assert again.path.stat().st_ino == inode  # the same folder kept, not rebuilt under a reader
    capsys.readouterr()
    pair = MemoryChannel.pair("host", "m1")[::-1]
    moved = await fetch_via(server, *pair, range(2, 5), False, cache, progress=True, label="m1 weights")
    bar = capsys.readouterr().err  # progress on stderr (not a terminal here: lines, not a bar)
    assert "kafila: m1 weights: fetched 100% (" in bar
    block4, nbytes = share(full, range(4, 5), False)
    assert sorted(moved.fetched) == sorted(block4) and moved.tensor_bytes == nbytes
    assert moved.meta_bytes == 0
    # what the member says (kafila.session.start): fetched and cached counts of these real results
    total, meta = (first.tensor_bytes + first.meta_bytes) / 1e6, first.meta_bytes / 1e6
    assert first.meta_bytes > 0  # the headers and the tokenizer's files came too
    assert weights_source(first) == (
        f"{total:.1f} MB fetched from the host ({len(first.tensors)} tensors, "
        f"{meta:.1f} MB of headers and files)"
    )
    assert weights_source(again) == f"all {len(again.tensors)} tensors from the local cache, nothing fetched"
    cached = len(moved.tensors) - len(block4)
    assert weights_source(moved).endswith(f"({len(block4)} tensors), {cached} tensors from the local cache")
    assert set(Checkpoint.open(moved.path).tensors) == set(full.names_for(range(2, 5), False))


async def test_a_blob_damaged_on_disk_after_caching_is_fetched_again_and_a_touched_one_is_rehashed(
    folder, full, tmp_path, capsys
) -> None:
    """A cached blob overwritten in place (same size, header intact) was loaded as it was; its stamp
    now says it changed, it is hashed again and, not matching, fetched again. One only touched
    (same bytes, new mtime) hashes right and is kept; an unchanged one is not even read."""
    server = WeightServer(folder, cache=tmp_path / "host")
    cache = tmp_path / "member"
    first = await fetch_via(server, *MemoryChannel.pair("host", "m1")[::-1], range(2, 4), False, cache)
    names = sorted(first.tensors)
    blobs = BlobStore(cache / "blobs")
    damaged, touched = ((first.path / _link(first.path, n)).resolve() for n in names[:2])
    assert damaged.parent.parent == blobs.root
    ((_, info),) = read_header(damaged).items()
    with open(damaged, "r+b") as f:  # flip one data byte in place
        f.seek(info.start)
        byte = f.read(1)
        f.seek(info.start)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(touched, ns=(time.time_ns(), time.time_ns() + 10**9))
    again = await fetch_via(server, *MemoryChannel.pair("host", "m1")[::-1], range(2, 4), False, cache)
    assert again.fetched == (names[0],) and again.tensor_bytes == full.tensors[names[0]].nbytes
    assert damaged.read_bytes()[info.start : info.end] == bytes(full.read([names[0]])[names[0]][1])
    said = capsys.readouterr()  # the log, wherever structlog writes it in this process
    assert "weights_blob_damaged" in said.out + said.err and names[1] not in again.fetched
    for blob in (damaged, touched):  # both trusted again: their digests remembered as they are now
        saved = json.loads(blobs.hashes._entry(blob).read_text())
        assert saved["stamp"] == file_stamp(blob.stat())
        assert list(saved["sha256"]) == list(read_header(blob))  # the blob's one tensor


def _link(shard: Path, name: str) -> str:
    return json.loads((shard / "model.safetensors.index.json").read_text())["weight_map"][name]


async def test_head_shard_carries_tokenizer_chat_template_and_special_tokens(folder, tmp_path) -> None:
    model = tmp_path / "with-tokenizer"
    shutil.copytree(folder, model)
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    (model / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (model / "notes.txt").write_text("not a model file: never offered")
    server = WeightServer(model, cache=tmp_path / "host")
    r = await fetch_via(server, *MemoryChannel.pair("host", "m0")[::-1], range(0, 2), True, tmp_path / "m0")
    shard, original = Checkpoint.open(r.path), Checkpoint.open(model)
    assert shard.tokenizer_file is not None and original.tokenizer_file is not None
    assert shard.tokenizer_file.read_bytes() == original.tokenizer_file.read_bytes()
    assert shard.chat_template == original.chat_template is not None
    assert shard.special_tokens == original.special_tokens and shard.special_tokens.eos == "</s>"
    assert shard.generation_config == original.generation_config and shard.config == original.config
    assert not (r.path / "notes.txt").exists()


async def test_member_with_the_same_files_locally_fetches_nothing(folder, tmp_path) -> None:
    server = WeightServer(folder, cache=tmp_path / "host")
    member, host = MemoryChannel.pair("host", "m2")[::-1]
    serving = asyncio.ensure_future(server.serve(host, timeout=30))
    r = await fetch_shard(member, range(4, 5), False, cache=tmp_path / "m2", local=[folder], progress=False)
    await asyncio.wait_for(serving, 10)
    assert r.local and r.path == folder.resolve() and r.bytes_fetched == 0
    assert server.stats.get("m2") is None  # not one fetch request
    assert (
        weights_source(r)
        == f"this machine's own copy of the checkpoint ({folder.resolve()}), nothing fetched"
    )
    assert not (tmp_path / "m2" / "blobs").exists()


async def test_member_finds_the_same_model_among_its_cached_models(folder, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "cache" / "models" / "another"
    (other).mkdir(parents=True)
    (other / "config.json").write_text("{}")  # a folder that is not this checkpoint is skipped
    shutil.copytree(folder, tmp_path / "cache" / "models" / "tiny")
    server = WeightServer(folder, cache=tmp_path / "host")
    member, host = MemoryChannel.pair("host", "m0")[::-1]
    serving = asyncio.ensure_future(server.serve(host, timeout=30))
    r = await fetch_shard(member, range(0, 2), True, progress=False)  # default cache and local folders
    await asyncio.wait_for(serving, 10)
    assert r.local and r.path == (tmp_path / "cache" / "models" / "tiny").resolve() and r.bytes_fetched == 0


async def test_local_copy_with_same_headers_but_other_bytes_is_not_used(folder, full, tmp_path) -> None:
    """A fine-tune has the same headers: the digest matches, the tensor hashes do not."""
    copy = tmp_path / "finetune"
    shutil.copytree(folder, copy)
    info = full.tensors[full.names_for(range(4, 5), False)[0]]
    with open(copy / info.file.name, "r+b") as f:
        f.seek(info.start)
        f.write(bytes(b ^ 0xFF for b in f.read(4)))
    server = WeightServer(folder, cache=tmp_path / "host")
    pair = MemoryChannel.pair("host", "m2")[::-1]
    serving = asyncio.ensure_future(server.serve(pair[1], timeout=30))
    r = await fetch_shard(pair[0], range(4, 5), False, cache=tmp_path / "m2", local=[copy], progress=False)
    await asyncio.wait_for(serving, 10)
    assert not r.local and r.tensor_bytes == share(full, range(4, 5), False)[1]


async def test_host_dispatch_loop_with_handle_and_other_messages_interleaved(folder, full, tmp_path) -> None:
    """A host whose own receive loop owns the channel hands weights messages to `handle`; other
    session messages on the channel (both ways) do not disturb the fetch."""
    server = WeightServer(folder, max_request=4096, cache=tmp_path / "host")
    member, host = MemoryChannel.pair("host", "m1")[::-1]
    others: list[t.Message] = []

    async def host_loop() -> None:
        while True:
            msg = await host.recv(10)
            if isinstance(msg, t.FetchRequest) and msg.fetch_id % 5 == 0:
                await host.send(t.Control("session.state", {"members": 3}))  # unrelated traffic
            if not await server.handle(host, msg):
                others.append(msg)
            if isinstance(msg, t.Control) and msg.op == "weights.done":
                return

    loop = asyncio.ensure_future(host_loop())
    await member.send(t.Control("hello", {"from": "m1"}))
    r = await fetch_shard(member, range(2, 4), False, cache=tmp_path / "m1", local=[], progress=False)
    await asyncio.wait_for(loop, 10)
    assert others == [t.Control("hello", {"from": "m1"})]
    assert r.tensor_bytes == share(full, range(2, 4), False)[1]
    assert server.stats["m1"].bytes_sent == r.bytes_fetched


async def ask(server: WeightServer, req: t.FetchRequest) -> t.Message:
    member, host = MemoryChannel.pair("host", "m")[::-1]
    await server.handle(host, req)
    return await member.recv(5)


async def test_host_refuses_ranges_outside_tensor_data_and_files_outside_the_checkpoint(
    folder, full, tmp_path
) -> None:
    server = WeightServer(folder, max_request=1 << 16, cache=tmp_path / "host")
    info = next(iter(full.tensors.values()))
    file, size = info.file.name, info.file.stat().st_size
    ok = await ask(server, t.FetchRequest(1, file, info.start, info.nbytes))
    assert isinstance(ok, t.FetchData) and ok.data == bytes(full.read([info.name])[info.name][1])
    bad = [
        (t.FetchRequest(2, file, size - 4, 8), "not inside its header or tensor data"),
        (t.FetchRequest(3, file, size + 100, 8), "not inside its header or tensor data"),
        (t.FetchRequest(4, "../" + file, 0, 8), "not part of the checkpoint"),
        (t.FetchRequest(5, "model.safetensors.index.json", 0, 8), "not part of the checkpoint"),
        (t.FetchRequest(6, "/etc/passwd", 0, 8), "not part of the checkpoint"),
        (t.FetchRequest(7, file, info.start, (1 << 16) + 1), "requests must be 1..65536 bytes"),
        (t.FetchRequest(8, file, info.start, 0), "requests must be 1..65536 bytes"),
    ]
    for req, text in bad:
        reply = await ask(server, req)
        assert isinstance(reply, t.Error), req
        assert reply.request_id == req.fetch_id and reply.code == "fetch_refused"
        assert text in reply.message and req.file in reply.message  # names the file and why


async def test_member_reports_a_refusal_clearly(folder, tmp_path) -> None:
    """A host with a smaller request limit than it announces (simulated misbehaving host)."""
    server = WeightServer(folder, cache=tmp_path / "host")
    await server.prepare()
    server.max_request = 16  # the manifest already went out saying 4 MiB
    with pytest.raises(WeightsError, match=r"refused .* fetch_refused: .*requests must be 1\.\.16 bytes"):
        await fetch_via(server, *MemoryChannel.pair("host", "m1")[::-1], range(2, 4), False, tmp_path / "m")


class DamagingChannel:
    """The member's end of a channel where the response to the first request for (`file`, `offset`)
    arrives damaged (simulated bad link or bad host; everything else is the real code path)."""

    def __init__(
        self, inner: MemoryChannel, file: str, offset: int, damage: Callable[[bytes], bytes]
    ) -> None:
        self.inner, self.target, self.damage = inner, (file, offset), damage
        self.peer, self.counters = inner.peer, inner.counters
        self.asked: dict[int, tuple[str, int]] = {}
        self.damaged = 0

    @property
    def path(self) -> str:
        return self.inner.path

    async def send(self, msg: t.Message) -> None:
        if isinstance(msg, t.FetchRequest):
            self.asked[msg.fetch_id] = (msg.file, msg.offset)
        await self.inner.send(msg)

    async def recv(self, timeout: float | None = None) -> t.Message:
        msg = await self.inner.recv(timeout)
        if isinstance(msg, t.FetchData) and self.asked.get(msg.fetch_id) == self.target and not self.damaged:
            self.damaged += 1
            return t.FetchData(msg.fetch_id, self.damage(msg.data))
        return msg

    async def close(self, reason: str = "closed") -> None:
        await self.inner.close(reason)


def truncate(d: bytes) -> bytes:
    return d[:-7]


def flip(d: bytes) -> bytes:
    return d[:10] + bytes([d[10] ^ 1]) + d[11:]


@pytest.mark.parametrize(
    ("target", "damage", "error"),
    [
        ("tensor", truncate, r"sent \d+ bytes for a \d+-byte request \(truncated or corrupt"),
        ("tensor", flip, r"tensor .* do not match the sha256 the host announced .*; not cached"),
        ("header", flip, r"headers do not match its checkpoint id; not cached"),
        ("config", flip, r"config.json: fetched bytes do not match the host's sha256; not cached"),
    ],
    ids=["tensor-truncated", "tensor-flipped-bit", "header-flipped-bit", "config-flipped-bit"],
)
async def test_damaged_response_is_detected_and_not_cached(
    folder, full, tmp_path, target, damage, error
) -> None:
    names, nbytes = share(full, range(2, 4), False)
    victim = full.tensors[names[0]]  # a run of the share starts at its first tensor
    where = {
        "tensor": (victim.file.name, victim.start),
        "header": (victim.file.name, 0),
        "config": ("config.json", 0),
    }[target]
    server = WeightServer(folder, max_request=1 << 20, cache=tmp_path / "host")
    cache = tmp_path / "m1"
    member, host = MemoryChannel.pair("host", "m1")[::-1]
    serving = asyncio.ensure_future(server.serve(host, timeout=2))
    damaged = DamagingChannel(member, *where, damage)
    with pytest.raises(WeightsError, match=error):
        await fetch_shard(damaged, range(2, 4), False, cache=cache, local=[], progress=False, window=2)
    assert damaged.damaged == 1
    await asyncio.wait_for(serving, 10)
    blobs = BlobStore(cache / "blobs")
    cached = list(blobs.root.rglob("*.safetensors")) if blobs.root.exists() else []
    assert len(cached) < len(names)  # the damaged tensor is not among them ...
    for blob in cached:  # ... and every blob that was cached holds the host's exact bytes
        ((tname, info),) = read_header(blob).items()
        assert blob.read_bytes()[info.start : info.end] == bytes(full.read([tname])[tname][1])
    for f in (cache / "weights").rglob("files/*"):  # every cached small file and header is the host's
        source = folder / f.name.removesuffix(".header")
        assert source.read_bytes()[: f.stat().st_size] == f.read_bytes()
    retry = await fetch_via(server, member, host, range(2, 4), False, cache)  # same channel: stale
    assert 0 < retry.tensor_bytes <= nbytes  # answers to the failed fetch are skipped
    assert retry.tensor_bytes == sum(full.tensors[n].nbytes for n in retry.fetched)
    assert set(Checkpoint.open(retry.path).tensors) == set(names)


async def test_a_damaged_tensor_stops_the_fetch_at_once_not_after_the_whole_share(
    folder, full, tmp_path
) -> None:
    """A store that failed (a bad digest here, a full disk alike) was seen only once every request of
    the share had been answered: on a slow link, a multi-GB wait for an error found at the start."""
    names, nbytes = share(full, range(0, 4), True)
    first = min((full.tensors[n] for n in names), key=lambda i: (i.file.name, i.start))
    server = WeightServer(folder, max_request=4096, cache=tmp_path / "host")
    member, host = MemoryChannel.pair("host", "m1")[::-1]
    serving = asyncio.ensure_future(server.serve(host, timeout=2))
    damaged = DamagingChannel(member, first.file.name, first.start, flip)
    with pytest.raises(WeightsError, match="fetched bytes do not match the sha256"):
        await fetch_shard(
            damaged, range(0, 4), True, cache=tmp_path / "m1", local=[], progress=False, window=2
        )
    await asyncio.wait_for(serving, 10)
    assert member.counters.bytes_received < nbytes / 4  # stopped early (4 KiB requests, 2 in flight)


async def test_simulated_unwritable_cache_is_one_error_naming_the_cache(folder, tmp_path) -> None:
    """A full or read-only disk was a raw OSError traceback; here the cache's blob folder is a file."""
    server = WeightServer(folder, cache=tmp_path / "host")
    cache = tmp_path / "m1"
    cache.mkdir()
    (cache / "blobs").write_text("not a folder")
    member, host = MemoryChannel.pair("host", "m1")[::-1]
    with pytest.raises(
        WeightsError, match=rf"^cannot use the weight cache under {cache}: .*set KAFILA_CACHE"
    ) as err:
        await fetch_via(server, member, host, range(0, 2), False, cache)
    assert "free space" not in str(err.value)  # the disk is not full: a file where a folder must be
    assert server.stats["m1"].error == str(err.value)  # the host learns why (and says it: start.py)


async def test_a_file_changed_on_the_host_after_describing_is_refused(folder, tmp_path) -> None:
    """A host whose checkpoint file is rewritten mid-session (a new download over it) must not serve
    bytes whose digests the manifest does not hold: the member's fetch fails naming the change."""
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    server = WeightServer(copy, cache=tmp_path / "host")
    await server.prepare()
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # rewritten: the host can no longer vouch for the digests
    st = weights.stat()  # (file times can be as coarse as a clock tick: make the new one certain)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(WeightsError, match="the file changed on the host after the session described it"):
        await fetch_via(server, *MemoryChannel.pair("host", "m1")[::-1], range(0, 2), False, tmp_path / "m")
    again = WeightServer(copy, cache=tmp_path / "host")  # a restarted host describes the new file
    done = await fetch_via(again, *MemoryChannel.pair("host", "m2")[::-1], range(0, 2), False, tmp_path / "m")
    assert done.tensor_bytes > 0


async def test_damaged_cache_files_are_rebuilt_not_fatal(folder, full, tmp_path) -> None:
    """A host hash entry that is JSON but not an object, a host hash folder that is a file, and a
    member shard index that is JSON but not an object: each was an AttributeError or
    FileExistsError that left the other side waiting (30 s for the member, or for ever for the host)."""
    server = WeightServer(folder, cache=tmp_path / "host")
    member = tmp_path / "member"
    first = await fetch_via(server, *MemoryChannel.pair("host", "m1")[::-1], range(0, 2), False, member)
    for entry in (tmp_path / "host" / "weights" / "hashes").iterdir():
        entry.write_text("[]")
    (first.path / "model.safetensors.index.json").write_text("[]")
    again = await fetch_via(
        WeightServer(folder, cache=tmp_path / "host"),
        *MemoryChannel.pair("host", "m1")[::-1],
        range(0, 2),
        False,
        member,
    )
    assert again.bytes_fetched == 0 and set(Checkpoint.open(again.path).tensors) == set(first.tensors)
    (tmp_path / "host2" / "weights").mkdir(parents=True)
    (tmp_path / "host2" / "weights" / "hashes").write_text("a file where the hash folder goes")
    other = await fetch_via(
        WeightServer(folder, cache=tmp_path / "host2"),
        *MemoryChannel.pair("host", "m1")[::-1],
        range(0, 2),
        False,
        member,
    )
    assert set(other.tensors) == set(first.tensors)


async def test_a_damaged_cached_header_is_fetched_again_in_the_same_attempt(folder, tmp_path) -> None:
    """It ended the attempt (and so the whole session, on every member) blaming the host; the
    next attempt fetched it. The cached copy is the suspect: it is fetched again at once."""
    server, member = WeightServer(folder, cache=tmp_path / "host"), tmp_path / "member"
    first = await fetch_via(server, *MemoryChannel.pair("host", "m1")[::-1], range(0, 2), False, member)
    headers = list(member.rglob("files/*.header"))
    for header in headers:  # one bit flipped in this member's cache, the size kept
        data = bytearray(header.read_bytes())
        data[10] ^= 1
        header.write_bytes(data)
    again = await fetch_via(server, *MemoryChannel.pair("host", "m1")[::-1], range(0, 2), False, member)
    assert set(again.tensors) == set(first.tensors) and again.tensor_bytes == 0
    assert again.meta_bytes == sum(h.stat().st_size for h in headers)  # the headers alone, once
    for header in headers:
        assert (
            header.read_bytes()
            == (folder / header.name.removesuffix(".header")).read_bytes()[: header.stat().st_size]
        )


def test_a_killed_stores_part_file_is_swept_once_old_and_a_fresh_one_kept(tmp_path) -> None:
    """kill -9 while a tensor was written left its .part in the cache for good."""
    import os
    import time

    blobs = BlobStore(tmp_path / "blobs")
    blob = blobs.put("ab" + "0" * 62, "w", "F32", (2,), bytes(8))
    old, fresh = blob.parent / ".x.safetensors.a1.part", blob.parent / ".y.safetensors.b2.part"
    for part in (old, fresh):
        part.write_bytes(bytes(1024))
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert blobs.sweep(time.time() - 3600) == 1
    assert not old.exists() and fresh.exists() and blob.exists()
    assert BlobStore(tmp_path / "none").sweep(time.time()) == 0  # no cache yet


def test_a_blob_written_range_by_range_out_of_order_is_the_same_blob_and_a_dropped_one_leaves_nothing(
    tmp_path,
) -> None:
    import hashlib
    import time

    blobs = BlobStore(tmp_path / "blobs")
    data = bytes(range(256)) * 40  # 10,240 bytes
    key, sha = "cd" + "1" * 62, hashlib.sha256(data).hexdigest()
    part = blobs.part(key, "w", "U8", (len(data),), len(data))
    assert blobs.sweep(time.time() + 1) == 1  # a part file the sweep would remove if left behind
    part = blobs.part(key, "w", "U8", (len(data),), len(data))
    for a in (8192, 0, 4096):  # as a window of responses may come
        part.write_at(a, memoryview(data)[a : a + 4096])
    with pytest.raises(ValueError, match="outside a 10240-byte tensor"):
        part.write_at(8192, data[:4096])
    assert part.sha256() == sha
    blob = part.keep()
    whole = blobs.put("ef" + "2" * 62, "w", "U8", (len(data),), data)
    assert blob.read_bytes() == whole.read_bytes()  # header and bytes as a blob written at once
    blobs.hashes.remember(blob, {"w": sha})
    assert blobs.has(key, "w", "U8", (len(data),), len(data), sha)
    dropped = blobs.part("aa" + "3" * 62, "w", "U8", (4,), 4)
    dropped.write_at(0, b"abcd")
    dropped.discard()
    assert not list(blobs.root.rglob("*.part")) and not blobs.path("aa" + "3" * 62).exists()
    with pytest.raises(OSError, match="written after it was kept or dropped"):  # a cancelled write's thread
        dropped.write_at(0, b"abcd")


def test_progress_piped_to_a_file_is_a_line_at_every_tenth(capsys) -> None:
    """Under a log file, tqdm's bar was one endless line of carriage returns."""
    from kafila.session.weights.fetch import LineProgress, _Member

    bar = _Member(MemoryChannel.pair("a", "b")[0], Path("."), 1, 1.0, True, "beta").bar(20_000_000)
    assert isinstance(bar, LineProgress)  # stderr is not a terminal under pytest
    with bar:
        for _ in range(200):
            bar.update(100_000)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 10 and "\r" not in "".join(lines)
    assert lines[0] == "kafila: beta: fetched 10% (2.0 of 20.0 MB)"
    assert lines[-1] == "kafila: beta: fetched 100% (20.0 of 20.0 MB)"


def test_progress_on_a_terminal_is_a_bar(monkeypatch) -> None:
    from tqdm import tqdm

    from kafila.session.weights.fetch import _Member

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with _Member(MemoryChannel.pair("a", "b")[0], Path("."), 1, 1.0, True, "beta").bar(100) as bar:
        assert isinstance(bar, tqdm)


def test_cache_files_and_shard_folders_get_the_permissions_any_file_would(tmp_path) -> None:
    """mkstemp/mkdtemp made them 0600/0700: a cache shared by a machine's users was unreadable."""
    from kafila.session.weights.cache import UMASK, ShardFolder, build_shard_folder

    blob = BlobStore(tmp_path / "blobs").put("cd" + "0" * 62, "w", "F32", (2,), bytes(8))
    assert blob.stat().st_mode & 0o777 == 0o666 & ~UMASK
    folder = build_shard_folder(ShardFolder(tmp_path / "shard", {}, {"w": blob}))
    assert folder.stat().st_mode & 0o777 == 0o777 & ~UMASK


async def test_a_packed_head_shard_brings_its_embedding_scales_and_loads_packed(
    tiny_checkpoint, tmp_path
) -> None:
    """A q4 folder (`kafila models --quantize q4`): the head's share is the packed embedding with
    its scales (manifest.stage_tensors), fetched as packed bytes, and the shard loads in q4 to the
    logits of the whole packed folder."""
    from kafila.models.quantize import quantize_folder

    packed = quantize_folder(tiny_checkpoint("llama-gqa3-tied"), "q4", tmp_path / "q4", progress=False)
    full = Checkpoint.open(packed)
    member, host = MemoryChannel.pair("host", "m0")
    server = WeightServer(packed, cache=tmp_path / "host")
    r = await fetch_via(server, host, member, range(0, 1), True, tmp_path / "m0")
    names, nbytes = share(full, range(0, 1), True)
    assert "model.embed_tokens.scales" in r.fetched and sorted(r.fetched) == sorted(names)
    assert (
        r.tensor_bytes
        == nbytes
        < sum(
            i.nbytes
            for i in Checkpoint.open(tiny_checkpoint("llama-gqa3-tied")).tensors.values()
            if i.name in names
        )
    )
    shard = Stage.load(
        Checkpoint.open(r.path), range(0, 1), True, backend="torch", dtype="fp32", context=32, quant="q4"
    )
    whole = Stage.load(full, range(0, 1), True, backend="torch", dtype="fp32", context=32, quant="q4")
    assert shard.model.quant == "q4"
    np.testing.assert_array_equal(chained_logits([shard], [5, 9, 1]), chained_logits([whole], [5, 9, 1]))


def slow_hashing_simulated(monkeypatch, per_tensor_s: float, stall_after: int | None = None) -> object:
    """The host's hashing slowed (a simulated slow disk): each tensor's real sha256 takes
    `per_tensor_s` longer; after `stall_after` tensors it waits on the returned event."""
    import threading

    from kafila.session.weights import cache

    real, count, release = cache.sha256_range, [0], threading.Event()

    def slow(fd: int, start: int, end: int) -> str:
        count[0] += 1
        if stall_after is not None and count[0] > stall_after:
            release.wait(30)
        time.sleep(per_tensor_s)
        return real(fd, start, end)

    monkeypatch.setattr(cache, "sha256_range", slow)
    return release


async def test_a_member_waits_as_long_as_the_hosts_slow_hashing_simulated_advances(
    folder, full, tmp_path, monkeypatch, capsys
) -> None:
    """The hashing takes several times the member's timeout; the host's progress keeps the wait
    going, and the member says how far the host got."""
    n = len(full.tensors)
    slow_hashing_simulated(monkeypatch, 2.0 / n)
    server = WeightServer(folder, cache=tmp_path / "host", progress_every=0.1)
    member, host = MemoryChannel.pair("host", "m1")[::-1]
    t0 = time.monotonic()
    r = await fetch_via(server, member, host, range(2, 4), False, tmp_path / "m1", timeout=0.6, progress=True)
    assert time.monotonic() - t0 > 3 * 0.6  # the hashing outlasted the timeout several times over
    assert r.tensor_bytes == share(full, range(2, 4), False)[1]
    said = [x for x in capsys.readouterr().err.splitlines() if "hashed its checkpoint" in x]
    assert said and said[-1].startswith("kafila: weights: host: hashed its checkpoint ")
    assert len(said) <= 10  # a line at a tenth at most, not one per progress message


async def test_a_host_whose_hashing_stalls_simulated_fails_the_member_naming_how_far_it_got(
    folder, full, tmp_path, monkeypatch
) -> None:
    release = slow_hashing_simulated(monkeypatch, 0.0, stall_after=2)
    server = WeightServer(folder, cache=tmp_path / "host", progress_every=0.1)
    member, host = MemoryChannel.pair("host", "m1")[::-1]
    serving = asyncio.ensure_future(server.serve(host, timeout=30))
    try:
        with pytest.raises(
            WeightsError, match=r"hashing had reached 0\.\d\d of 0\.\d\d GB and did not advance for 1 s"
        ):
            await fetch_shard(
                member, range(2, 4), False, cache=tmp_path / "m1", local=[], timeout=1.0, progress=False
            )
    finally:
        release.set()  # type: ignore[attr-defined]
        serving.cancel()
    assert 0 < server.hashed[0] < server.hashed[1]


async def test_tensors_written_to_their_blobs_as_they_arrive_are_checked_before_they_are_kept(
    folder, full, tmp_path, monkeypatch
) -> None:
    """Every tensor large enough (here: any of one byte or more) goes to its blob's `.part` file
    range by range, never whole in memory: a damaged range leaves neither a blob nor a part file,
    and the next fetch stores the host's exact bytes, which load."""
    from kafila.session.weights import fetch

    monkeypatch.setattr(fetch, "SPOOL_BYTES", 1)
    names, _ = share(full, range(0, 2), True)
    victim = min((full.tensors[n] for n in names), key=lambda i: (i.file.name, i.start))
    server = WeightServer(folder, max_request=4096, cache=tmp_path / "host")  # several ranges a tensor
    cache = tmp_path / "m1"
    member, host = MemoryChannel.pair("host", "m1")[::-1]
    serving = asyncio.ensure_future(server.serve(host, timeout=2))
    damaged = DamagingChannel(member, victim.file.name, victim.start, flip)
    with pytest.raises(WeightsError, match="fetched bytes do not match the sha256"):
        await fetch_shard(damaged, range(0, 2), True, cache=cache, local=[], progress=False, window=4)
    await asyncio.wait_for(serving, 10)
    blobs = BlobStore(cache / "blobs")
    assert not list(blobs.root.rglob("*.part"))
    retry = await fetch_via(server, member, host, range(0, 2), True, cache, window=4)
    shard = Checkpoint.open(retry.path)
    assert set(shard.tensors) == set(names) and not list(blobs.root.rglob("*.part"))
    want, got = full.read(names), shard.read(names)
    for n in names:
        assert bytes(got[n][1]) == bytes(want[n][1]), n
