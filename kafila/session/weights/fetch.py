"""A member fetches its shard: manifest, ranged requests in flight, checks, the cache, a shard folder
that `Checkpoint.open` reads unchanged (the protocol: kafila.session.weights.manifest)."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import hashlib
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafila.models.cache import models_dir
from kafila.models.checkpoint import Checkpoint, CheckpointError
from kafila.models.manifest import stage_tensors
from kafila.obs.log import get_logger
from kafila.proto import tensor as t
from kafila.session.channel import Channel, ChannelError
from kafila.session.weights.cache import (
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
    U32_MAX,
    TensorEntry,
    WeightManifest,
    WeightsError,
    headers_digest,
    parse_header,
    read_headers,
    runs,
)

log = get_logger(__name__)


DEFAULT_WINDOW = 8  # requests a member keeps in flight


_FETCH_IDS = itertools.count()


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
                fid = next(_FETCH_IDS) % U32_MAX + 1  # unique in this process: stale answers are known
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
    for a, b in runs(spans):
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
