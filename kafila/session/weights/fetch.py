"""A member fetches its shard: manifest, ranged requests in flight, checks, the cache, a shard folder
that `Checkpoint.open` reads unchanged (the protocol: kafila.session.weights.manifest)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import hashlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafila.models.cache import models_dir
from kafila.models.checkpoint import Checkpoint, CheckpointError
from kafila.models.manifest import stage_tensors
from kafila.obs import metrics
from kafila.obs.log import get_logger
from kafila.proto import tensor as t
from kafila.session.channel import Channel, ChannelError
from kafila.session.weights.cache import (
    BlobPart,
    BlobStore,
    HashCache,
    ShardFolder,
    build_shard_folder,
    cache_root,
    write_atomic,
)
from kafila.session.weights.manifest import (
    OP_DONE,
    OP_GET_MANIFEST,
    OP_MANIFEST,
    OP_PREPARING,
    TensorEntry,
    WeightManifest,
    WeightsError,
    headers_digest,
    parse_header,
    read_headers,
)
from kafila.session.weights.sources import ChannelReader, Job, Reader, Sink, chunks

log = get_logger(__name__)


DEFAULT_WINDOW = 8  # requests a member keeps in flight
SPOOL_BYTES = 8 << 20  # a tensor at least this large is written to its blob's file as it arrives
STORING = 2  # whole tensors being checked and written at once; the next waits (bounds the buffers held)


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
    sources: dict[str, int] = field(default_factory=dict)  # source ("peer m1", "host h") -> bytes
    kinds: dict[str, int] = field(default_factory=dict)  # kind (peer, mirror, host) -> bytes
    manifest: WeightManifest | None = None  # what the host offered (None: nothing asked)

    @property
    def bytes_fetched(self) -> int:
        return self.tensor_bytes + self.meta_bytes


@dataclass
class _Pending:
    """A tensor being assembled from responses. Its buffer is made when its first bytes come and
    dropped once stored: a shard's buffers are never all resident at once (`bytearray(n)` writes
    its n zero bytes, so a buffer made ahead costs its size at once). A tensor of SPOOL_BYTES or
    more is not assembled in memory at all: each range goes to its blob's `.part` file as it
    comes (a member that keeps replicas while it serves holds no whole embedding beside its
    stage)."""

    entry: TensorEntry
    missing: int
    buf: bytearray | None = None
    part: BlobPart | None = None

    @property
    def spooled(self) -> bool:
        return self.entry.nbytes >= SPOOL_BYTES

    def into(self) -> bytearray:
        if self.buf is None:
            self.buf = bytearray(self.entry.nbytes)
        return self.buf

    async def write(self, blobs: BlobStore, offset: int, data: memoryview) -> None:
        """The tensor's bytes at `offset`: into its buffer, or its blob's file (off the loop)."""
        if not self.spooled:
            self.into()[offset : offset + len(data)] = data
            return
        if self.part is None:  # made at once, on the loop: a mirror's sinks run side by side
            e = self.entry
            self.part = blobs.part(e.key, e.name, e.dtype, e.shape, e.nbytes)
        await asyncio.to_thread(self.part.write_at, offset, data)

    def discard(self) -> None:
        """Drop what came of an unfinished tensor (its `.part` file)."""
        self.buf = None
        if self.part is not None:
            part, self.part = self.part, None
            part.discard()


class _Tally:
    """Bytes received per source (reader name) and per kind, with the progress bar."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.by_name: dict[str, int] = {}
        self.kinds: dict[str, str] = {}
        self.meta = 0

    def sink(self, reader: Reader, inner: Sink, meta: bool = False) -> Sink:
        self.kinds[reader.name] = reader.kind

        async def counted(job: Job, data: bytes) -> None:
            self.by_name[reader.name] = self.by_name.get(reader.name, 0) + len(data)
            self.meta += len(data) if meta else 0
            self.bar.update(len(data))
            await inner(job, data)

        return counted

    @property
    def total(self) -> int:
        return sum(self.by_name.values())


class LineProgress:
    """Progress for a log file: `label: fetched 30% (64.8 of 216.0 MB)` at every tenth done."""

    def __init__(self, total: int, label: str, verb: str = "fetched") -> None:
        self.total, self.label, self.verb, self.n, self._said = total, label, verb, 0, 0

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
                f"kafila: {self.label}: {self.verb} {10 * tenth}% ({done:.1f} of {total:.1f} MB)",
                file=sys.stderr,
            )


class _HostHashing:
    """A member's wait for the manifest of a host that is hashing its checkpoint: the deadline
    moves with each advance the host reports; progress lines at every tenth when `label` is set."""

    def __init__(self, host: str, timeout: float, label: str | None) -> None:
        self.host, self.timeout, self.label = host, timeout, label
        self.start = self.since = time.monotonic()
        self.hashed, self.total = -1, 0
        self.lines: LineProgress | None = None

    def left(self) -> float:
        return max(0.0, self.timeout - (time.monotonic() - self.since))

    def heard(self, hashed: int, total: int) -> None:
        if self.hashed < 0:
            log.info("weights_host_hashing", host=self.host, hashed=hashed, total=total)
            if self.label is not None and total:
                self.lines = LineProgress(total, f"{self.label}: {self.host}", "hashed its checkpoint")
        if hashed > self.hashed:
            if self.lines is not None:
                self.lines.update(hashed - max(self.hashed, 0))
            self.hashed, self.total, self.since = hashed, total, time.monotonic()

    def done(self) -> None:
        if self.hashed >= 0:
            log.info("weights_host_hashed", host=self.host, waited_s=round(time.monotonic() - self.start, 1))

    def __str__(self) -> str:
        if self.hashed < 0:
            return ""
        return (
            f" (its hashing had reached {self.hashed / 1e9:.2f} of {self.total / 1e9:.2f} GB and did "
            f"not advance for {self.timeout:.0f} s)"
        )


PART_AGE_S = 3600.0  # a blob's .part file this old is a write that was killed, not one in progress


class _Member:
    def __init__(
        self, channel: Channel | None, cache: Path, window: int, timeout: float, progress: bool, label: str
    ):
        self.channel, self.root, self.window, self.timeout = channel, cache, window, timeout
        self.progress, self.label = progress, label
        self.blobs = BlobStore(cache / "blobs")

    async def manifest(self) -> WeightManifest:
        """The host's manifest. A host still hashing its checkpoint says how far it got every few
        seconds: the wait lasts while that advances, and ends `timeout` s after it last did."""
        assert self.channel is not None
        await self.channel.send(t.Control(OP_GET_MANIFEST))
        waiting = _HostHashing(self.channel.peer, self.timeout, self.label if self.progress else None)
        while True:
            try:
                msg = await self.channel.recv(waiting.left())
            except ChannelError as exc:
                raise WeightsError(f"weights manifest from {self.channel.peer}: {exc}{waiting}") from exc
            if isinstance(msg, t.Control) and msg.op == OP_PREPARING:
                waiting.heard(int(msg.body.get("hashed", 0)), int(msg.body.get("total", 0)))
            if isinstance(msg, t.Control) and msg.op == OP_MANIFEST:
                waiting.done()
                return WeightManifest.from_json(msg.body)
            if isinstance(msg, t.Error):
                raise WeightsError(f"host {self.channel.peer}: {msg.code}: {msg.message}")

    async def missing(self, entries: list[TensorEntry]) -> list[TensorEntry]:
        """The entries this member's blob store lacks (a blob changed since it was stored is hashed)."""
        has = self.blobs.has
        return await asyncio.to_thread(
            lambda: [e for e in entries if not has(e.key, e.name, e.dtype, e.shape, e.nbytes, e.sha256)]
        )

    async def gather(
        self,
        m: WeightManifest,
        entries: list[TensorEntry],
        todo: list[TensorEntry],
        readers: Sequence[Reader],
        folder: Path,
        result: ShardResult,
    ) -> None:
        """Fetch `todo` and the checkpoint's headers and small files from `readers`, and make
        `folder`, which Checkpoint.open reads, of `entries`: the result's path, fetched and bytes."""
        with self.bar(sum(e.nbytes for e in todo)) as bar:
            tally = _Tally(bar)
            files = await self.meta(m, folder.parent, readers, tally)
            bar.total = (bar.total or 0) + tally.meta
            await self.tensors(todo, m, readers, tally)
        _account(result, tally)
        result.fetched = tuple(e.name for e in todo)
        shard = ShardFolder(folder, files, {e.name: self.blobs.path(e.key) for e in entries})
        result.path = await asyncio.to_thread(build_shard_folder, shard)

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

    async def meta(
        self, m: WeightManifest, ckdir: Path, readers: Sequence[Reader], tally: _Tally
    ) -> dict[str, Path]:
        """Headers (checked against the manifest) and small files (checked by sha256) into ckdir,
        each from the first source that offers it and sends it right (the last one's, the host's,
        checked as a whole below)."""
        files_dir = ckdir / "files"
        want: dict[str, tuple[int, str | None]] = {f"{k}": v for k, v in m.files.items()}
        want.update({f"{k}.header": (n, None) for k, n in m.headers.items()})
        valid = await asyncio.to_thread(lambda: [n for n in want if _valid(files_dir / n, *want[n])])
        bufs: dict[str, bytearray] = {}
        missing = [name for name in want if name not in valid]
        for reader in readers:
            last = reader is readers[-1]
            todo = [n for n in missing if n not in bufs and reader.offers(n.removesuffix(".header"), 0, 1)]
            if todo:
                got = await self._meta_from(reader, m, want, todo, tally, last)
                bufs.update(got)
        try:
            peer = self.channel.peer if self.channel is not None else "?"
            await asyncio.to_thread(_check_and_keep_meta, m, files_dir, want, bufs, peer)
        except CachedHeadersSuspect as exc:  # removed: this second pass fetches every header
            log.warning("weights_cached_headers_refetched", reason=str(exc))
            return await self.meta(m, ckdir, readers, tally)
        return {k: files_dir / k for k in m.files}

    async def _meta_from(
        self,
        reader: Reader,
        m: WeightManifest,
        want: dict[str, tuple[int, str | None]],
        names: list[str],
        tally: _Tally,
        last: bool,
    ) -> dict[str, bytearray]:
        """`names` (small files, `<file>.header`) from `reader`: those that came whole and, from a
        source before the last, check on their own (sha256; a header's tensors as the manifest lists)."""
        bufs = {n: bytearray(want[n][0]) for n in names}
        left = {n: want[n][0] for n in names}
        jobs = [
            j for n in names for j in chunks(n.removesuffix(".header"), [(0, want[n][0])], reader.max_request)
        ]

        async def sink(job: Job, data: bytes) -> None:
            name = job.file if job.file in bufs and job.file in m.files else f"{job.file}.header"
            bufs[name][job.offset : job.offset + len(data)] = data
            left[name] -= len(data)

        try:
            await reader.run(jobs, tally.sink(reader, sink, meta=True))
        except WeightsError as exc:
            if last:
                raise
            log.warning("weights_source_failed", source=reader.name, error=str(exc))
        whole = {n: b for n, b in bufs.items() if left[n] == 0}
        if last:
            return whole
        good = {n: b for n, b in whole.items() if _meta_ok(m, n, b, want[n][1])}
        for n in sorted(set(whole) - set(good)):
            log.warning("weights_range_rejected", source=reader.name, file=n, reason="digest")
        return good

    async def tensors(
        self, entries: list[TensorEntry], m: WeightManifest, readers: Sequence[Reader], tally: _Tally
    ) -> None:
        """Fetch `entries` from the first source that offers each, then from the next for those a
        source failed to send right; each tensor's size and sha256 checked before the blob store."""
        await asyncio.to_thread(self.blobs.sweep, time.time() - PART_AGE_S)
        left = list(entries)
        for reader in readers:
            last = reader is readers[-1]
            mine = [e for e in left if last or reader.offers(e.file, e.start, e.end)]
            if mine:
                stored = await self._tensors_from(reader, mine, tally, last)
                left = [e for e in left if e.name not in stored]
        if left:
            raise WeightsError(
                f"{len(left)} tensors (first: {left[0].name}) came right from none of the "
                f"{len(readers)} sources ({', '.join(r.name for r in readers)})"
            )

    async def _tensors_from(
        self, reader: Reader, entries: list[TensorEntry], tally: _Tally, last: bool
    ) -> set[str]:
        """The names of `entries` that came from `reader` and hashed right (now in the blob store).
        From the last source a failure raises; from another it leaves the tensor to the next."""
        by_file: dict[str, list[TensorEntry]] = {}
        for e in entries:
            by_file.setdefault(e.file, []).append(e)
        jobs: list[Job] = []
        index: dict[str, tuple[list[int], list[_Pending]]] = {}
        for file, es in by_file.items():
            es.sort(key=lambda e: e.start)
            jobs += chunks(file, [(e.start, e.end) for e in es], reader.max_request)
            index[file] = ([e.start for e in es], [_Pending(e, e.nbytes) for e in es])
        failed: list[BaseException] = []  # a store that failed stops the fetch at once
        stored: set[str] = set()

        def note_result(task: asyncio.Future[str | None]) -> None:
            if (exc := task.exception()) is not None:
                failed.append(exc)
            elif (name := task.result()) is not None:
                stored.add(name)

        def store(p: _Pending) -> asyncio.Future[str | None]:
            task = asyncio.ensure_future(asyncio.to_thread(self._store, p, reader.name, last))
            task.add_done_callback(note_result)
            return task

        writes = [store(p) for _, parts in index.values() for p in parts if p.missing == 0]  # empty ones

        async def sink(job: Job, data: bytes) -> None:
            if failed:  # a full disk, a bad digest: not after the whole share has come
                raise failed[0]
            starts, parts = index[job.file]
            i = max(0, bisect.bisect_right(starts, job.offset) - 1)
            a, b = job.offset, job.offset + len(data)
            while i < len(parts) and parts[i].entry.start < b:
                p = parts[i]
                lo, hi = max(a, p.entry.start), min(b, p.entry.end)
                if hi > lo:
                    await p.write(self.blobs, lo - p.entry.start, memoryview(data)[lo - a : hi - a])
                    p.missing -= hi - lo
                    if p.missing == 0:
                        writes.append(store(p))
                i += 1
            storing = [w for w in writes if not w.done()]
            if len(storing) > STORING:  # the disk is slower than the source: hold the next responses
                await asyncio.wait(storing, return_when=asyncio.FIRST_COMPLETED)

        try:
            await reader.run(jobs, tally.sink(reader, sink))
        except WeightsError as exc:
            if last:
                raise
            log.warning("weights_source_failed", source=reader.name, error=str(exc))
        finally:
            results = await asyncio.gather(*writes, return_exceptions=True)
            for _, parts in index.values():
                for p in parts:
                    p.discard()  # those that did not come whole
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return stored

    def _store(self, p: _Pending, source: str, strict: bool) -> str | None:
        """Check `p`'s bytes and keep them: its name, or None when they do not hash right and a
        later source may send them (`strict`: there is none, WeightsError)."""
        e, blob = p.entry, None
        if p.spooled:  # written to its blob's file as it came (its first bytes made the file)
            part, p.part = p.part, None
            assert part is not None
            try:
                blob = part.keep() if part.sha256() == e.sha256 else None
            finally:
                part.discard()  # nothing is left after keep()
        else:
            buf, p.buf = p.into(), None  # the bytes go with this call
            if hashlib.sha256(buf).hexdigest() == e.sha256:
                blob = self.blobs.put(e.key, e.name, e.dtype, e.shape, buf)
        if blob is None:
            if not strict:
                log.warning("weights_range_rejected", source=source, tensor=e.name, nbytes=e.nbytes)
                return None
            raise WeightsError(
                f"tensor {e.name} ({e.nbytes} bytes from {e.file}): fetched bytes do not match the sha256 "
                f"the host announced (its file, or its remembered digest under <cache>/weights/hashes, "
                f"changed after hashing); not cached"
            )
        self.blobs.hashes.remember(blob, {e.name: e.sha256})  # checked above: not hashed again on reuse
        return e.name


def _meta_ok(m: WeightManifest, name: str, buf: bytearray, sha: str | None) -> bool:
    """A small file hashes to its sha256; a header says exactly the tensors the manifest lists."""
    if sha is not None:
        return hashlib.sha256(buf).hexdigest() == sha
    file = name.removesuffix(".header")
    listed = {e.name: (e.dtype, e.shape, e.start, e.end) for e in m.tensors.values() if e.file == file}
    try:
        return parse_header(file, bytes(buf)) == listed
    except WeightsError:
        return False


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
    """The tensors of blocks [a, b) (+ the head's) in the manifest, as Checkpoint.names_for picks them
    (stage_tensors: in a packed folder, the head's embedding scales and minimums too)."""
    if blocks.step != 1 or blocks.start < 0 or blocks.stop > m.n_blocks or blocks.start > blocks.stop:
        raise WeightsError(
            f"block range [{blocks.start}, {blocks.stop}) is not inside the {m.n_blocks} blocks"
        )
    return stage_tensors(m.tensors, blocks, head)


def _local_match(
    m: WeightManifest, names: list[str], folders: Sequence[Path], hashes: HashCache
) -> Path | None:
    """A folder holding the same checkpoint (same headers digest) whose shard tensors hash right."""
    for folder in folders:
        try:
            if not (folder / "config.json").is_file():
                continue
            if headers_digest(read_headers(folder, sorted(m.headers))) != m.checkpoint:
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
    sources: Sequence[Reader] = (),
    on_manifest: Callable[[WeightManifest], None] | None = None,
) -> ShardResult:
    """Fetch the tensors of blocks [a, b) (+ the head's when `head`) into the cache and return a
    folder `Checkpoint.open` reads. The host at the other end of `channel` gives the manifest and
    is the last source; `sources` (members holding ranges, a mirror) are asked first, in order.

    `cache`: cache root (default registry.cache_dir()). `local`: folders that may hold the same
    checkpoint (default: the model folders in the cache); one whose headers digest matches and whose
    shard tensors hash right is used as is, fetching nothing. `window`: requests in flight.
    The member owns the channel's receive side until this returns (other messages are skipped).
    `on_manifest` hears the manifest as soon as it came (a member serving others needs it).
    """
    root = cache_root(cache)
    try:
        return await _fetch_shard(
            channel, blocks, head, root, local, window, timeout, progress, label, sources, on_manifest
        )
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


async def usable(sources: Sequence[Reader], m: WeightManifest) -> list[Reader]:
    """The sources that can offer something of `m`'s checkpoint (each asked at once)."""

    async def ready(r: Reader) -> bool:
        try:
            return await r.prepare(m)
        except WeightsError as exc:
            log.warning("weights_source_failed", source=r.name, error=str(exc))
            return False

    answers = await asyncio.gather(*(ready(r) for r in sources))
    return [r for r, ok in zip(sources, answers, strict=True) if ok]


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
    sources: Sequence[Reader],
    on_manifest: Callable[[WeightManifest], None] | None,
) -> ShardResult:
    member = _Member(channel, root, window, timeout, progress, label)
    m = await member.manifest()
    if on_manifest is not None:
        on_manifest(m)
    names = shard_names(m, blocks, head)
    hashes = HashCache(root / "weights" / "hashes")
    found = await asyncio.to_thread(
        _local_match, m, names, _default_local() if local is None else local, hashes
    )
    result = ShardResult(Path(), m.checkpoint, blocks, head, tuple(names), manifest=m)
    if found is not None:
        result.path, result.local = found, True
        await channel.send(t.Control(OP_DONE, {"bytes": 0, "tensors": 0}))
        log.info("weights_local", folder=str(found), checkpoint=m.checkpoint[:16], tensors=len(names))
        return result
    ckdir = root / "weights" / m.checkpoint[:16]
    entries = [m.tensors[n] for n in names]
    todo = await member.missing(entries)
    host = ChannelReader(channel, "host", window, timeout, m.max_request)
    readers = [*(await usable(sources, m) if todo else []), host]
    tag = f"shard-{blocks.start}-{blocks.stop}{'-head' if head else ''}"
    await member.gather(m, entries, todo, readers, ckdir / tag, result)
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
        sources=result.sources,
    )
    return result


@dataclass
class Kept:
    """Tensors fetched into the blob store alone (replicas): names, and bytes by source and kind."""

    tensors: tuple[str, ...] = ()
    sources: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)


async def fetch_tensors(
    m: WeightManifest, names: Sequence[str], readers: Sequence[Reader], cache: Path | None = None
) -> Kept:
    """Tensors `names` of `m` into the blob store from `readers` in order (each checked against
    its sha256; those already held hash right and are not fetched). No shard folder: these are
    kept to be served, and loaded by a later plan's fetch without asking anyone."""
    member = _Member(None, cache_root(cache), 1, 30.0, False, "replicas")
    entries = [m.tensors[n] for n in names]
    todo = await member.missing(entries)
    tally = _Tally(member.bar(0))
    if todo:
        await member.tensors(todo, m, list(await usable(readers, m)), tally)
    kept = Kept(tuple(e.name for e in todo), dict(tally.by_name))
    for name, n in tally.by_name.items():
        kind = tally.kinds[name]
        kept.kinds[kind] = kept.kinds.get(kind, 0) + n
        metrics.observe_weight_bytes(kind, n)
    return kept


def not_offered(m: WeightManifest, readers: Sequence[Reader], cache: Path | None = None) -> list[str]:
    """The tensors of `m` this member's blob store lacks and none of `readers` (prepared) offers
    (blocking: a blob changed since it was stored is hashed)."""
    blobs = BlobStore(cache_root(cache) / "blobs")
    return [
        e.name
        for e in m.tensors.values()
        if not blobs.has(e.key, e.name, e.dtype, e.shape, e.nbytes, e.sha256)
        and not any(r.offers(e.file, e.start, e.end) for r in readers)
    ]


async def fetch_whole(
    m: WeightManifest, readers: Sequence[Reader], cache: Path | None = None, label: str = "weights"
) -> ShardResult:
    """Every tensor of checkpoint `m` into the blob store from `readers` in order (those held are
    not fetched; each checked against its sha256 as any fetch's), with its headers and small
    files, and a folder of all of them that `Checkpoint.open` reads: what a member that took over
    from a lost host loads from and serves when it holds no copy of the checkpoint of its own."""
    root = cache_root(cache)
    member = _Member(None, root, DEFAULT_WINDOW, 30.0, True, label)
    entries = list(m.tensors.values())
    todo = await member.missing(entries)
    ckdir = root / "weights" / m.checkpoint[:16]
    result = ShardResult(Path(), m.checkpoint, range(m.n_blocks), True, tuple(m.tensors), manifest=m)
    await member.gather(m, entries, todo, readers, ckdir / "whole", result)
    log.info(
        "weights_gathered",
        checkpoint=m.checkpoint[:16],
        tensors=len(entries),
        fetched=len(todo),
        tensor_bytes=result.tensor_bytes,
        meta_bytes=result.meta_bytes,
        sources=result.sources,
    )
    return result


def _account(result: ShardResult, tally: _Tally) -> None:
    """The bytes each source sent into `result` and the kafila_weight_fetched_bytes counter."""
    result.meta_bytes = tally.meta
    result.tensor_bytes = tally.total - tally.meta
    result.sources = dict(tally.by_name)
    for name, n in tally.by_name.items():
        kind = tally.kinds[name]
        result.kinds[kind] = result.kinds.get(kind, 0) + n
        metrics.observe_weight_bytes(kind, n)


async def fetch_for_plan(channel: Channel, plan: Any, member: str, **kwargs: Any) -> ShardResult:
    """`fetch_shard` for member `member`'s stage in a kafila.planner Plan (its blocks and head flag)."""
    stage = plan.stage(member)
    return await fetch_shard(channel, range(stage.start, stage.stop), stage.head, **kwargs)
