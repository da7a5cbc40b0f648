"""Per-shard weight fetch: a member fetches exactly its tensors from the host's safetensors files.

Over a session Channel (kafila.session.channel; an authenticated QUIC link or an in-process pair):

    member -> host   CONTROL  weights.get_manifest
    host -> member   CONTROL  weights.manifest {checkpoint, max_request, files, headers, tensors}
    member -> host   FETCH_REQUEST {fetch_id, file, offset, length}     (several in flight)
    host -> member   FETCH_DATA fetch_id | bytes     or   ERROR {request_id: fetch_id, code, message}
    member -> host   CONTROL  weights.done {bytes, tensors}

The host answers only files of its checkpoint, only ranges inside a safetensors header, inside
tensor data, or inside one of the small files (config.json, tokenizer.json, ...), at most
`max_request` bytes each; reads run on a worker thread. The member checks every safetensors header
it fetched against the manifest (names, dtypes, shapes, byte ranges), every response's size, and
every tensor's sha256 before caching it (kafila.session.weights.cache), then builds a shard folder that
`Checkpoint.open` / `Stage.load` read unchanged. See docs/weights.md.

    server = WeightServer(folder)                       # host, once per session
    await server.serve(channel)                         # per member, until it says done
    shard = await fetch_shard(channel, range(4, 9), head=False)   # member
    stage = Stage.load(Checkpoint.open(shard.path), range(4, 9), False)
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import hashlib
import itertools
import json
import math
import os
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafila.models.cache import models_dir
from kafila.models.checkpoint import MAX_HEADER_BYTES, Checkpoint, CheckpointError
from kafila.models.manifest import DTYPE_BYTES, EMBED, FINAL_NORM, LM_HEAD, block_index
from kafila.obs.log import get_logger
from kafila.proto import tensor as t
from kafila.session.channel import Channel, ChannelError
from kafila.session.weights.cache import (
    BlobStore,
    HashCache,
    ShardFolder,
    blob_key,
    build_shard_folder,
    cache_root,
    file_stamp,
    write_atomic,
)

log = get_logger(__name__)

OP_GET_MANIFEST = "weights.get_manifest"
OP_MANIFEST = "weights.manifest"
OP_DONE = "weights.done"
# Small files a member needs besides tensors (those present are offered, whole).
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
MAX_SMALL_FILE = 64 << 20  # a "small" file larger than this is not offered
DEFAULT_MAX_REQUEST = 1 << 20  # bytes per FETCH_REQUEST the host accepts (window x this = bytes queued)
DEFAULT_WINDOW = 8  # requests a member keeps in flight
_U32_MAX = (1 << 32) - 1  # FETCH_DATA carries the fetch id as a u32
_FETCH_IDS = itertools.count()


class WeightsError(RuntimeError):
    """The fetch failed (refused, truncated, corrupt, or a checkpoint mismatch); the text says which."""


class FetchRefused(ValueError):
    """A host-side refusal of one FETCH_REQUEST (becomes an ERROR reply)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str  # safetensors file name inside the checkpoint folder
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets in `file`
    end: int
    sha256: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def key(self) -> str:
        return blob_key(self.name, self.dtype, self.shape, self.sha256)


@dataclass(frozen=True)
class WeightManifest:
    """What a host offers: its checkpoint id (the digest of its safetensors headers), the request
    size limit, small files (size, sha256), header lengths and every tensor with its sha256."""

    checkpoint: str
    max_request: int
    files: dict[str, tuple[int, str]]  # small file -> (size, sha256)
    headers: dict[str, int]  # safetensors file -> header bytes (8 + N)
    tensors: dict[str, TensorEntry]
    n_blocks: int

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "max_request": self.max_request,
            "n_blocks": self.n_blocks,
            "files": {k: list(v) for k, v in self.files.items()},
            "headers": self.headers,
            "tensors": [
                [e.name, e.file, e.dtype, list(e.shape), e.start, e.end, e.sha256]
                for e in self.tensors.values()
            ],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WeightManifest:
        try:
            tensors = {}
            for name, file, dtype, shape, start, end, sha in d["tensors"]:
                tensors[str(name)] = TensorEntry(
                    str(name),
                    str(file),
                    str(dtype),
                    tuple(int(x) for x in shape),
                    int(start),
                    int(end),
                    str(sha),
                )
            files = {str(k): (int(v[0]), str(v[1])) for k, v in d["files"].items()}
            headers = {str(k): int(v) for k, v in d["headers"].items()}
            m = cls(str(d["checkpoint"]), int(d["max_request"]), files, headers, tensors, int(d["n_blocks"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsError(f"host sent a malformed weights manifest: {exc!r}") from None
        if m.max_request < 1 or any(Path(f).name != f or f in (".", "..") for f in [*files, *headers]):
            raise WeightsError("host sent a weights manifest with a bad file name or request size")
        return m


def headers_digest(headers: dict[str, bytes]) -> str:
    """The checkpoint id: sha256 over each safetensors file's name and header bytes, by name."""
    h = hashlib.sha256()
    for name in sorted(headers):
        raw = headers[name]
        h.update(name.encode() + b"\0" + struct.pack("<Q", len(raw)) + raw)
    return h.hexdigest()


def checkpoint_id(folder: Path) -> str:
    """The id of the checkpoint in `folder` (its headers' digest, as `describe` gives it)."""
    ckpt = Checkpoint.open(folder, complete=True)
    return headers_digest(_read_headers(ckpt.path, sorted({i.file.name for i in ckpt.tensors.values()})))


def parse_header(file: str, raw: bytes) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """Header bytes (8-byte length + JSON) -> {name: (dtype, shape, start, end)}, absolute offsets,
    with the same checks as Checkpoint (known dtype, byte count = numel * itemsize)."""
    if len(raw) < 8 or struct.unpack_from("<Q", raw)[0] != len(raw) - 8 or len(raw) - 8 > MAX_HEADER_BYTES:
        raise WeightsError(f"{file}: header of {len(raw)} bytes does not match its length prefix")
    try:
        header = json.loads(raw[8:].decode("utf-8"))
        header.pop("__metadata__", None)
        out = {}
        for name, e in header.items():
            dtype, shape, (a, b) = e["dtype"], tuple(int(x) for x in e["shape"]), e["data_offsets"]
            if dtype not in DTYPE_BYTES or int(b) - int(a) != math.prod(shape) * DTYPE_BYTES[dtype] or a < 0:
                raise WeightsError(f"{file}: tensor {name} {dtype}{list(shape)} has byte range [{a}, {b})")
            out[name] = (dtype, shape, len(raw) + int(a), len(raw) + int(b))
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        raise WeightsError(f"{file}: corrupt safetensors header: {exc!r}") from None
    return out


def _read_headers(folder: Path, files: Sequence[str]) -> dict[str, bytes]:
    out = {}
    for name in files:
        with open(folder / name, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{folder / name}: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{folder / name}: header length {n} is corrupt")
            out[name] = head + f.read(n)
    return out


def describe(
    folder: Path, max_request: int = DEFAULT_MAX_REQUEST, cache: Path | None = None
) -> WeightManifest:
    """The host's manifest of a checkpoint folder (blocking: hashes tensors not hashed before)."""
    ckpt = Checkpoint.open(folder, complete=True)
    hashes = HashCache(cache_root(cache) / "weights" / "hashes")
    by_file: dict[Path, list[Any]] = {}
    for info in ckpt.tensors.values():
        by_file.setdefault(info.file, []).append(info)
    tensors = {}
    for file, infos in sorted(by_file.items()):
        digests = hashes.digests(file, infos)
        for i in infos:
            tensors[i.name] = TensorEntry(
                i.name, file.name, i.dtype, i.shape, i.start, i.end, digests[i.name]
            )
    header_bytes = _read_headers(ckpt.path, sorted(f.name for f in by_file))
    files = {}
    for name in SMALL_FILES:
        p = ckpt.path / name
        if p.is_file() and p.stat().st_size <= MAX_SMALL_FILE:
            data = p.read_bytes()
            files[name] = (len(data), hashlib.sha256(data).hexdigest())
    return WeightManifest(
        checkpoint=headers_digest(header_bytes),
        max_request=max_request,
        files=files,
        headers={k: len(v) for k, v in header_bytes.items()},
        tensors=tensors,
        n_blocks=ckpt.n_blocks,
    )


def _runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted [start, end) spans -> maximal runs of touching spans."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


# ---------------------------------------------------------------------------------------- host


@dataclass
class ServeStats:
    requests: int = 0
    bytes_sent: int = 0
    refused: int = 0
    error: str | None = None  # why the member stopped fetching, as it said in its weights.done


class WeightServer:
    """The host's side: answers weight fetches of one checkpoint folder on any number of channels."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        max_request: int = DEFAULT_MAX_REQUEST,
        cache: Path | None = None,
    ) -> None:
        self.folder = Path(folder).expanduser().resolve()
        self.max_request, self.cache = max_request, cache
        self.stats: dict[str, ServeStats] = {}
        self._manifest: WeightManifest | None = None
        self._allowed: dict[str, list[tuple[int, int]]] = {}
        self._stamps: dict[str, list[int] | None] = {}  # each served file as it was described
        self._lock = asyncio.Lock()

    async def prepare(self) -> WeightManifest:
        """Describe the checkpoint (on a thread; hashes are remembered across sessions)."""
        async with self._lock:
            if self._manifest is None:
                stamps = await asyncio.to_thread(_stamps, self.folder)  # before hashing: see _pread
                m = await asyncio.to_thread(describe, self.folder, self.max_request, self.cache)
                allowed = {name: [(0, size)] for name, (size, _) in m.files.items() if size}
                for file, hlen in m.headers.items():
                    spans = [(e.start, e.end) for e in m.tensors.values() if e.file == file]
                    allowed[file] = _runs([(0, hlen), *spans])
                self._manifest, self._allowed = m, allowed
                self._stamps = {name: stamps.get(name) for name in allowed}
                log.info(
                    "weights_prepared",
                    folder=str(self.folder),
                    checkpoint=m.checkpoint[:16],
                    tensors=len(m.tensors),
                )
            return self._manifest

    def check(self, req: t.FetchRequest) -> tuple[Path, int, int]:
        """The file, offset and length a request may read; FetchRefused saying why not."""
        runs = self._allowed.get(req.file)
        if runs is None:
            raise FetchRefused(f"file {req.file!r} is not part of the checkpoint being served")
        if req.fetch_id > _U32_MAX:
            raise FetchRefused(f"fetch id {req.fetch_id} does not fit the u32 of FETCH_DATA")
        if req.length < 1 or req.length > self.max_request:
            raise FetchRefused(
                f"{req.file}: request of {req.length} bytes; requests must be 1..{self.max_request} bytes"
            )
        a, b = req.offset, req.offset + req.length
        i = bisect.bisect_right(runs, (a, math.inf)) - 1
        if i < 0 or b > runs[i][1]:
            raise FetchRefused(
                f"{req.file}: bytes [{a}, {b}) are not inside its header or tensor data "
                f"(allowed runs: {runs[:4]}{' ...' if len(runs) > 4 else ''})"
            )
        return self.folder / req.file, a, req.length

    async def handle(self, channel: Channel, msg: t.Message) -> bool:
        """Answer `msg` if it is a weights message (True), else leave it to the caller (False).
        For a host whose receive loop owns the channel; `serve` does the same in its own loop."""
        if isinstance(msg, t.Control) and msg.op == OP_GET_MANIFEST:
            m = await self.prepare()
            await channel.send(t.Control(OP_MANIFEST, m.to_json()))
            return True
        if isinstance(msg, t.FetchRequest):
            await self._answer(channel, msg)
            return True
        if isinstance(msg, t.Control) and msg.op == OP_DONE:
            error = msg.body.get("error")
            if error is not None:  # kept for the host to say (a member that fetched nothing has no stats)
                self.stats.setdefault(channel.peer, ServeStats()).error = str(error)[:500]
            s = self.stats.get(channel.peer, ServeStats())
            (log.warning if error is not None else log.info)(
                "weights_served",
                peer=channel.peer,
                requests=s.requests,
                bytes=s.bytes_sent,
                refused=s.refused,
                member_bytes=msg.body.get("bytes"),
                error=msg.body.get("error"),
            )
            return True
        return False

    async def serve(self, channel: Channel, timeout: float | None = None) -> ServeStats:
        """Serve one member until it sends weights.done (or closes); returns what was sent."""
        await self.prepare()
        while True:
            try:
                msg = await channel.recv(timeout)
            except ChannelError:
                break
            await self.handle(channel, msg)
            if isinstance(msg, t.Control) and msg.op == OP_DONE:
                break
        return self.stats.get(channel.peer, ServeStats())

    async def _answer(self, channel: Channel, req: t.FetchRequest) -> None:
        await self.prepare()
        stats = self.stats.setdefault(channel.peer, ServeStats())
        stats.requests += 1
        try:
            path, offset, length = self.check(req)
            data = await asyncio.to_thread(_pread, path, offset, length, self._stamps.get(req.file))
        except FetchRefused as exc:
            stats.refused += 1
            log.warning("weights_fetch_refused", peer=channel.peer, reason=str(exc))
            await channel.send(t.Error(req.fetch_id, "fetch_refused", str(exc)))
            return
        except OSError as exc:
            await channel.send(t.Error(req.fetch_id, "fetch_failed", f"{req.file}: read failed: {exc}"))
            return
        stats.bytes_sent += len(data)
        await channel.send(t.FetchData(req.fetch_id, data))


def _stamps(folder: Path) -> dict[str, list[int]]:
    return {p.name: file_stamp(p.stat()) for p in folder.iterdir() if p.is_file()}


def _pread(path: Path, offset: int, length: int, stamp: list[int] | None) -> bytes:
    """Bytes [offset, offset + length) of `path`, as long as the file is the one the manifest
    described (the digests members check were taken of it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        now = file_stamp(os.fstat(fd))
        if now != stamp:
            raise OSError(
                f"the file changed on the host after the session described it (size, mtime_ns, inode: "
                f"{stamp} -> {now}); restart the host to serve the new contents"
            )
        parts, at = [], offset
        while at < offset + length:
            chunk = os.pread(fd, offset + length - at, at)
            if not chunk:
                break
            parts.append(chunk)
            at += len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


# -------------------------------------------------------------------------------------- member


@dataclass
class ShardResult:
    """A member's shard: `path` loads with Checkpoint.open (a cached shard folder, or the member's
    own copy of the same checkpoint). Byte counts are payload bytes received in FETCH_DATA."""

    path: Path
    checkpoint: str
    blocks: range
    head: bool
    tensors: tuple[str, ...]
    fetched: tuple[str, ...] = ()  # tensors fetched now (the rest came from the cache)
    tensor_bytes: int = 0  # tensor bytes fetched now
    meta_bytes: int = 0  # header and small-file bytes fetched now
    local: bool = False  # True: `path` is the member's own copy; nothing was fetched

    @property
    def bytes_fetched(self) -> int:
        return self.tensor_bytes + self.meta_bytes


@dataclass
class _Job:
    file: str
    offset: int
    length: int


@dataclass
class _Pending:
    """A tensor being assembled from responses."""

    entry: TensorEntry
    buf: bytearray
    missing: int


@dataclass
class _Fetch:
    channel: Channel
    window: int
    timeout: float
    bar: Any
    received: int = 0

    async def run(self, jobs: list[_Job], sink: Any) -> None:
        """Fetch every job with up to `window` requests in flight; `sink(job, data)` takes each."""
        queue = list(reversed(jobs))
        pending: dict[int, _Job] = {}
        while queue or pending:
            while queue and len(pending) < self.window:
                job = queue.pop()
                fid = next(_FETCH_IDS) % _U32_MAX + 1  # unique in this process: stale answers are known
                pending[fid] = job
                await self.channel.send(t.FetchRequest(fid, job.file, job.offset, job.length))
            try:
                msg = await self.channel.recv(self.timeout)
            except ChannelError as exc:
                raise WeightsError(f"weights fetch from {self.channel.peer}: {exc}") from exc
            if isinstance(msg, t.Error) and msg.request_id in pending:
                job = pending[msg.request_id]
                raise WeightsError(
                    f"host {self.channel.peer} refused {job.file} bytes [{job.offset}, "
                    f"{job.offset + job.length}): {msg.code}: {msg.message}"
                )
            if isinstance(msg, t.Error) and msg.request_id == 0:  # the link or session failed
                raise WeightsError(f"host {self.channel.peer}: {msg.code}: {msg.message}")
            if not isinstance(msg, t.FetchData):
                log.debug("weights_ignored_message", kind=msg.kind.name)
                continue
            if msg.fetch_id not in pending:  # an answer to an earlier, abandoned fetch on this channel
                log.debug("weights_stale_answer", fetch_id=msg.fetch_id)
                continue
            job = pending.pop(msg.fetch_id)
            if len(msg.data) != job.length:
                raise WeightsError(
                    f"{job.file} bytes [{job.offset}, {job.offset + job.length}): host {self.channel.peer} "
                    f"sent {len(msg.data)} bytes for a {job.length}-byte request (truncated or corrupt "
                    f"response); nothing from it was cached"
                )
            self.received += len(msg.data)
            self.bar.update(len(msg.data))
            await sink(job, msg.data)


def _chunks(file: str, spans: list[tuple[int, int]], max_request: int) -> list[_Job]:
    jobs = []
    for a, b in _runs(spans):
        jobs += [_Job(file, o, min(max_request, b - o)) for o in range(a, b, max_request)]
    return jobs


class LineProgress:
    """Progress for a log file: `label: fetched 30% (64.8 of 216.0 MB)` at every tenth done."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.n, self._said = total, label, 0, 0

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        self.n += n
        tenth = min(10, int(10 * self.n / self.total)) if self.total else 10
        if tenth > self._said:
            self._said = tenth
            done, total = self.n / 1e6, self.total / 1e6
            print(
                f"kafila: {self.label}: fetched {10 * tenth}% ({done:.1f} of {total:.1f} MB)", file=sys.stderr
            )


PART_AGE_S = 3600.0  # a blob's .part file this old is a write that was killed, not one in progress


class _Member:
    def __init__(
        self, channel: Channel, cache: Path, window: int, timeout: float, progress: bool, label: str
    ):
        self.channel, self.root, self.window, self.timeout = channel, cache, window, timeout
        self.progress, self.label = progress, label
        self.blobs = BlobStore(cache / "blobs")

    async def manifest(self) -> WeightManifest:
        await self.channel.send(t.Control(OP_GET_MANIFEST))
        while True:
            try:
                msg = await self.channel.recv(self.timeout)
            except ChannelError as exc:
                raise WeightsError(f"weights manifest from {self.channel.peer}: {exc}") from exc
            if isinstance(msg, t.Control) and msg.op == OP_MANIFEST:
                return WeightManifest.from_json(msg.body)
            if isinstance(msg, t.Error):
                raise WeightsError(f"host {self.channel.peer}: {msg.code}: {msg.message}")

    def bar(self, total: int) -> Any:
        """A progress bar on a terminal; piped to a file, a line at every tenth (a tqdm bar there is
        one endless line of carriage returns, ~7 updates a second)."""
        from tqdm import tqdm

        if self.progress and total and not sys.stderr.isatty():
            return LineProgress(total, self.label)
        return tqdm(
            total=total,
            unit="B",
            unit_scale=True,  # in MB (1e6), as every other figure of kafila's
            file=sys.stderr,
            desc=self.label,
            disable=not self.progress or total == 0,
            leave=False,
        )

    async def meta(self, m: WeightManifest, ckdir: Path, fetch: _Fetch) -> dict[str, Path]:
        """Headers (checked against the manifest) and small files (checked by sha256) into ckdir."""
        files_dir = ckdir / "files"
        want: dict[str, tuple[int, str | None]] = {f"{k}": v for k, v in m.files.items()}
        want.update({f"{k}.header": (n, None) for k, n in m.headers.items()})
        valid = await asyncio.to_thread(lambda: [n for n in want if _valid(files_dir / n, *want[n])])
        have = {name: files_dir / name for name in valid}
        jobs = [
            job
            for name, (size, _) in want.items()
            if name not in have
            for job in _chunks(name.removesuffix(".header"), [(0, size)], m.max_request)
        ]
        bufs = {name: bytearray(size) for name, (size, _) in want.items() if name not in have}

        async def sink(job: _Job, data: bytes) -> None:
            name = job.file if job.file in bufs and job.file in m.files else f"{job.file}.header"
            bufs[name][job.offset : job.offset + len(data)] = data

        await fetch.run(jobs, sink)
        try:
            await asyncio.to_thread(_check_and_keep_meta, m, files_dir, want, bufs, self.channel.peer)
        except CachedHeadersSuspect as exc:  # removed: this second pass fetches every header
            log.warning("weights_cached_headers_refetched", reason=str(exc))
            return await self.meta(m, ckdir, fetch)
        return {k: files_dir / k for k in m.files}

    async def tensors(self, entries: list[TensorEntry], m: WeightManifest, fetch: _Fetch) -> None:
        """Fetch `entries`, verify each tensor's size and sha256, put it in the blob store."""
        await asyncio.to_thread(self.blobs.sweep, time.time() - PART_AGE_S)
        by_file: dict[str, list[TensorEntry]] = {}
        for e in entries:
            by_file.setdefault(e.file, []).append(e)
        jobs: list[_Job] = []
        index: dict[str, tuple[list[int], list[_Pending]]] = {}
        for file, es in by_file.items():
            es.sort(key=lambda e: e.start)
            jobs += _chunks(file, [(e.start, e.end) for e in es], m.max_request)
            index[file] = ([e.start for e in es], [_Pending(e, bytearray(e.nbytes), e.nbytes) for e in es])
        failed: list[BaseException] = []  # a store that failed stops the fetch at once

        def note_failure(task: asyncio.Future[None]) -> None:
            if (exc := task.exception()) is not None:
                failed.append(exc)

        def store(p: _Pending) -> asyncio.Future[None]:
            task = asyncio.ensure_future(asyncio.to_thread(self._store, p))
            task.add_done_callback(note_failure)
            return task

        writes = [store(p) for _, parts in index.values() for p in parts if p.missing == 0]  # empty ones

        async def sink(job: _Job, data: bytes) -> None:
            if failed:  # a full disk, a bad digest: not after the whole share has come
                raise failed[0]
            starts, parts = index[job.file]
            i = max(0, bisect.bisect_right(starts, job.offset) - 1)
            a, b = job.offset, job.offset + len(data)
            while i < len(parts) and parts[i].entry.start < b:
                p = parts[i]
                lo, hi = max(a, p.entry.start), min(b, p.entry.end)
                if hi > lo:
                    p.buf[lo - p.entry.start : hi - p.entry.start] = data[lo - a : hi - a]
                    p.missing -= hi - lo
                    if p.missing == 0:
                        writes.append(store(p))
                i += 1

        try:
            await fetch.run(jobs, sink)
        finally:
            results = await asyncio.gather(*writes, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    def _store(self, p: _Pending) -> None:
        e = p.entry
        if hashlib.sha256(p.buf).hexdigest() != e.sha256:
            raise WeightsError(
                f"tensor {e.name} ({e.nbytes} bytes from {e.file}): fetched bytes do not match the sha256 "
                f"the host announced (its file, or its remembered digest under <cache>/weights/hashes, "
                f"changed after hashing); not cached"
            )
        blob = self.blobs.put(e.key, e.name, e.dtype, e.shape, p.buf)
        self.blobs.hashes.remember(blob, {e.name: e.sha256})  # checked above: not hashed again on reuse
        p.buf = bytearray()


class CachedHeadersSuspect(WeightsError):
    """The headers did not match the checkpoint id and some came from the cache (now removed)."""


def _check_and_keep_meta(
    m: WeightManifest,
    files_dir: Path,
    want: dict[str, tuple[int, str | None]],
    bufs: dict[str, bytearray],
    peer: str,
) -> None:
    """Check fetched headers and small files (with the cached ones), then cache the fetched ones."""
    headers = {}
    for k in m.headers:
        h = f"{k}.header"
        headers[k] = bytes(bufs[h]) if h in bufs else (files_dir / h).read_bytes()
    try:
        _verify_headers(m, headers, peer)
    except WeightsError as exc:
        for k in m.headers:  # a cached header may be the bad one: fetch them all next time
            (files_dir / f"{k}.header").unlink(missing_ok=True)
        cached = [k for k in m.headers if f"{k}.header" not in bufs]
        if cached:
            raise CachedHeadersSuspect(
                f"{exc}; {len(cached)} of the headers came from this member's cache and may be the "
                "damaged ones: removed and fetched again"
            ) from exc
        raise
    for name, buf in bufs.items():
        sha = want[name][1]
        if sha is not None and hashlib.sha256(buf).hexdigest() != sha:
            raise WeightsError(f"{name}: fetched bytes do not match the host's sha256; not cached")
    for name, buf in bufs.items():
        write_atomic(files_dir / name, [buf])


def _verify_headers(m: WeightManifest, headers: dict[str, bytes], peer: str) -> None:
    """The headers hash to the manifest's checkpoint id and say exactly what the manifest lists."""
    if headers_digest(headers) != m.checkpoint:
        raise WeightsError(f"host {peer}: safetensors headers do not match its checkpoint id; not cached")
    stray = sorted({e.file for e in m.tensors.values()} - set(headers))
    if stray:
        raise WeightsError(f"host {peer}: manifest lists tensors in {stray[0]}, which has no header")
    for file, raw in headers.items():
        parsed = parse_header(file, raw)
        listed = {e.name: (e.dtype, e.shape, e.start, e.end) for e in m.tensors.values() if e.file == file}
        if parsed != listed:
            bad = sorted(set(parsed.items()) ^ set(listed.items()))[:1]
            raise WeightsError(f"{file}: manifest and header disagree about {bad}")


def _valid(path: Path, size: int, sha: str | None) -> bool:
    if not path.is_file() or path.stat().st_size != size:
        return False
    return sha is None or hashlib.sha256(path.read_bytes()).hexdigest() == sha


def shard_names(m: WeightManifest, blocks: range, head: bool) -> list[str]:
    """The tensors of blocks [a, b) (+ the head's) in the manifest, as Checkpoint.names_for picks them."""
    if blocks.step != 1 or blocks.start < 0 or blocks.stop > m.n_blocks or blocks.start > blocks.stop:
        raise WeightsError(
            f"block range [{blocks.start}, {blocks.stop}) is not inside the {m.n_blocks} blocks"
        )
    wanted = {EMBED, FINAL_NORM, LM_HEAD} if head else set()
    return [n for n in m.tensors if n in wanted or ((i := block_index(n)) is not None and i in blocks)]


def _local_match(
    m: WeightManifest, names: list[str], folders: Sequence[Path], hashes: HashCache
) -> Path | None:
    """A folder holding the same checkpoint (same headers digest) whose shard tensors hash right."""
    for folder in folders:
        try:
            if not (folder / "config.json").is_file():
                continue
            if headers_digest(_read_headers(folder, sorted(m.headers))) != m.checkpoint:
                continue
            ckpt = Checkpoint.open(folder)
            infos = [ckpt.tensors[n] for n in names]
            by_file: dict[Path, list[Any]] = {}
            for i in infos:
                by_file.setdefault(i.file, []).append(i)
            digests = {k: v for f, fi in by_file.items() for k, v in hashes.digests(f, fi).items()}
        except (OSError, CheckpointError, KeyError):
            continue
        bad = [n for n in names if digests[n] != m.tensors[n].sha256]
        if not bad:
            return ckpt.path
        log.warning("weights_local_differs", folder=str(folder), tensor=bad[0], differing=len(bad))
    return None


def _default_local() -> list[Path]:
    root = models_dir()
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


async def fetch_shard(
    channel: Channel,
    blocks: range,
    head: bool,
    *,
    cache: Path | None = None,
    local: Sequence[Path] | None = None,
    window: int = DEFAULT_WINDOW,
    timeout: float = 30.0,
    progress: bool = True,
    label: str = "weights",
) -> ShardResult:
    """Fetch the tensors of blocks [a, b) (+ the head's when `head`) from the host at the other end
    of `channel` into the cache and return a folder `Checkpoint.open` reads.

    `cache`: cache root (default registry.cache_dir()). `local`: folders that may hold the same
    checkpoint (default: the model folders in the cache); one whose headers digest matches and whose
    shard tensors hash right is used as is, fetching nothing. `window`: requests in flight.
    The member owns the channel's receive side until this returns (other messages are skipped).
    """
    root = cache_root(cache)
    try:
        return await _fetch_shard(channel, blocks, head, root, local, window, timeout, progress, label)
    except OSError as exc:  # a full disk, a read-only folder: one line naming the cache
        where = f" ({exc.filename})" if exc.filename else ""
        free = "free space there, or " if exc.errno == errno.ENOSPC else ""
        err = WeightsError(
            f"cannot use the weight cache under {root}: {exc.strerror or exc}{where}; {free}set "
            "KAFILA_CACHE to another folder"
        )
        await _stop_serving(channel, err)
        raise err from exc
    except Exception as exc:  # any failure, a bug too: the host must not wait for a `done` never sent
        await _stop_serving(channel, exc)
        raise


async def _stop_serving(channel: Channel, why: Exception) -> None:
    """Tell the host to stop serving this member, and why (it logs it)."""
    with contextlib.suppress(ChannelError):
        await channel.send(t.Control(OP_DONE, {"error": str(why)[:500]}))


async def _fetch_shard(
    channel: Channel,
    blocks: range,
    head: bool,
    root: Path,
    local: Sequence[Path] | None,
    window: int,
    timeout: float,
    progress: bool,
    label: str,
) -> ShardResult:
    member = _Member(channel, root, window, timeout, progress, label)
    m = await member.manifest()
    names = shard_names(m, blocks, head)
    hashes = HashCache(root / "weights" / "hashes")
    found = await asyncio.to_thread(
        _local_match, m, names, _default_local() if local is None else local, hashes
    )
    result = ShardResult(Path(), m.checkpoint, blocks, head, tuple(names))
    if found is not None:
        result.path, result.local = found, True
        await channel.send(t.Control(OP_DONE, {"bytes": 0, "tensors": 0}))
        log.info("weights_local", folder=str(found), checkpoint=m.checkpoint[:16], tensors=len(names))
        return result
    ckdir = root / "weights" / m.checkpoint[:16]
    entries = [m.tensors[n] for n in names]
    todo = await asyncio.to_thread(
        lambda: [
            e for e in entries if not member.blobs.has(e.key, e.name, e.dtype, e.shape, e.nbytes, e.sha256)
        ]
    )
    with member.bar(sum(e.nbytes for e in todo)) as bar:
        fetch = _Fetch(channel, window, timeout, bar)
        files = await member.meta(m, ckdir, fetch)
        result.meta_bytes = fetch.received
        bar.total = (bar.total or 0) + result.meta_bytes
        await member.tensors(todo, m, fetch)
        result.tensor_bytes = fetch.received - result.meta_bytes
    result.fetched = tuple(e.name for e in todo)
    tag = f"shard-{blocks.start}-{blocks.stop}{'-head' if head else ''}"
    shard = ShardFolder(ckdir / tag, files, {e.name: member.blobs.path(e.key) for e in entries})
    result.path = await asyncio.to_thread(build_shard_folder, shard)
    await channel.send(t.Control(OP_DONE, {"bytes": result.bytes_fetched, "tensors": len(todo)}))
    log.info(
        "weights_fetched",
        peer=channel.peer,
        checkpoint=m.checkpoint[:16],
        shard=tag,
        tensors=len(names),
        fetched=len(todo),
        tensor_bytes=result.tensor_bytes,
        meta_bytes=result.meta_bytes,
    )
    return result


async def fetch_for_plan(channel: Channel, plan: Any, member: str, **kwargs: Any) -> ShardResult:
    """`fetch_shard` for member `member`'s stage in a kafila.planner Plan (its blocks and head flag)."""
    stage = plan.stage(member)
    return await fetch_shard(channel, range(stage.start, stage.stop), stage.head, **kwargs)
