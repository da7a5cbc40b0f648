"""The host serves its checkpoint's bytes to members: only what the manifest names, by range, off the loop."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kafila.models.checkpoint import open_weights
from kafila.models.weight_file import INPLACE_SUFFIX, WeightFile, file_stamp
from kafila.obs.log import get_logger
from kafila.proto import tensor as t
from kafila.session.channel import Channel, ChannelError
from kafila.session.weights.manifest import (
    DEFAULT_MAX_REQUEST,
    OP_DONE,
    OP_GET_MANIFEST,
    OP_MANIFEST,
    OP_PREPARING,
    U32_MAX,
    FetchRefused,
    WeightManifest,
    describe,
    runs,
)

log = get_logger("kafila.session.weights")


PROGRESS_EVERY_S = 2.0  # while hashing, a member asking for the manifest hears how far it got this often


@dataclass
class ServeStats:
    requests: int = 0
    bytes_sent: int = 0
    refused: int = 0
    error: str | None = None  # why the member stopped fetching, as it said in its weights.done


class Ranges(Protocol):
    """A checkpoint described elsewhere and held as ranges of its own files (a member's cache:
    kafila.session.weights.peers.HeldFiles): its manifest, and a blocking read."""

    m: WeightManifest

    def read(self, file: str, offset: int, length: int) -> bytes: ...


class OpenFiles:
    """The weight files a server reads, each opened on first use and shared by the reads on any
    thread (positional reads; a GGUF served in place is a read-only map): `close` closes them once
    no read is using them (the last read out does), and a read after that opens them again."""

    def __init__(self) -> None:
        self._files: dict[Path, WeightFile] = {}
        self._lock = threading.Lock()
        self._using = 0
        self._closing = False

    @contextlib.contextmanager
    def use(self, path: Path) -> Iterator[WeightFile]:
        with self._lock:
            f = self._files.get(path)
            if f is None:  # a file that cannot be opened (a GGUF gone) is tried again at the next read
                f = self._files[path] = open_weights(path)
            self._using += 1
        try:
            yield f
        finally:
            with self._lock:
                self._using -= 1
                if self._closing and not self._using:
                    self._close()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            if not self._using:
                self._close()

    def _close(self) -> None:  # the lock held
        files, self._files, self._closing = list(self._files.values()), {}, False
        for f in files:
            f.close()


class WeightServer:
    """The host's side: answers weight fetches of one checkpoint folder on any number of channels.
    With `ranges`, the checkpoint is the one `ranges.m` describes, read from `ranges` (a member that
    took over from a lost host serves what its cache holds, in the original files' offsets).
    Each file is opened once, at its first range, and kept open until `close`."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        max_request: int = DEFAULT_MAX_REQUEST,
        cache: Path | None = None,
        progress_every: float = PROGRESS_EVERY_S,
        ranges: Ranges | None = None,
    ) -> None:
        self.folder = Path(folder).expanduser().resolve()
        self.max_request, self.cache, self.progress_every = max_request, cache, progress_every
        self.ranges = ranges
        self.hashed = (0, 0)  # tensor bytes described so far, of all (written by the describing thread)
        self.stats: dict[str, ServeStats] = {}
        self._manifest: WeightManifest | None = None
        self._allowed: dict[str, list[tuple[int, int]]] = {}
        self._stamps: dict[str, list[int] | None] = {}  # each served file as it was described
        self._files = OpenFiles()
        self._lock = asyncio.Lock()

    async def prepare(self) -> WeightManifest:
        """Describe the checkpoint (on a thread; hashes are remembered across sessions)."""
        async with self._lock:
            if self._manifest is None:
                stamps: dict[str, list[int]] = {}
                if self.ranges is not None:  # described by the host that made it
                    m = self.ranges.m
                    self.max_request = m.max_request
                else:
                    stamps = await asyncio.to_thread(_stamps, self.folder)  # before hashing: see _pread
                    m = await asyncio.to_thread(
                        describe, self.folder, self.max_request, self.cache, self._note_hashed
                    )
                allowed = {name: [(0, size)] for name, (size, _) in m.files.items() if size}
                for file, hlen in m.headers.items():
                    spans = [(e.start, e.end) for e in m.tensors.values() if e.file == file]
                    allowed[file] = runs([(0, hlen), *spans])
                self._manifest, self._allowed = m, allowed
                self._stamps = {name: stamps.get(name) for name in allowed}
                log.info(
                    "weights_prepared",
                    folder=str(self.folder),
                    checkpoint=m.checkpoint[:16],
                    tensors=len(m.tensors),
                )
            return self._manifest

    def _note_hashed(self, done: int, total: int) -> None:
        self.hashed = (done, total)

    async def _send_manifest(self, channel: Channel) -> None:
        """The manifest; while the checkpoint is still being hashed, how far that got every
        `progress_every` seconds, so a member waits as long as the hashing advances."""
        preparing = asyncio.ensure_future(self.prepare())
        while not preparing.done():
            await asyncio.wait({preparing}, timeout=self.progress_every)
            if not preparing.done():
                done, total = self.hashed
                await channel.send(t.Control(OP_PREPARING, {"hashed": done, "total": total}))
        await channel.send(t.Control(OP_MANIFEST, preparing.result().to_json()))

    def check(self, req: t.FetchRequest) -> tuple[Path, int, int]:
        """The file, offset and length a request may read; FetchRefused saying why not."""
        runs = self._allowed.get(req.file)
        if runs is None:
            raise FetchRefused(f"file {req.file!r} is not part of the checkpoint being served")
        if req.fetch_id > U32_MAX:
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

    def read_range(self, file: str, offset: int, length: int) -> bytes:
        """Bytes of the checkpoint's `file` a request may read (after `prepare`; blocking):
        FetchRefused naming why not, OSError when the file changed since it was described."""
        path, a, n = self.check(t.FetchRequest(1, file, offset, length))
        if self.ranges is not None:
            return self.ranges.read(file, a, n)
        with self._files.use(path) as f:
            return _pread(f, a, n, self._stamps.get(file))

    def close(self) -> None:
        """Close the files it opened to serve (after the reads in flight); a later read opens them again."""
        self._files.close()

    async def handle(self, channel: Channel, msg: t.Message) -> bool:
        """Answer `msg` if it is a weights message (True), else leave it to the caller (False).
        For a host whose receive loop owns the channel; `serve` does the same in its own loop."""
        if isinstance(msg, t.Control) and msg.op == OP_GET_MANIFEST:
            await self._send_manifest(channel)
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
        """Serve one member until it sends weights.done (or closes); returns what was sent. The
        checkpoint is described when first needed (a member asking while it is hashed hears how far)."""
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
            data = await asyncio.to_thread(self.read_range, req.file, req.offset, req.length)
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
    """Each file of the folder as it is now; a safetensors file made from a GGUF (its index beside
    it) by the GGUF's and the index's stamps."""
    stamps = {p.name: file_stamp(p.stat()) for p in folder.iterdir() if p.is_file()}
    for index in folder.glob(f"*{INPLACE_SUFFIX}"):
        with open_weights(folder / index.name.removesuffix(INPLACE_SUFFIX)) as f:
            stamps[f.path.name] = f.stamp()
    return stamps


def _pread(f: WeightFile, offset: int, length: int, stamp: list[int] | None) -> bytes:
    """Bytes [offset, offset + length) of `f`, as long as what its path names now is the file the
    manifest described (the digests members check were taken of it): not written since, nor
    replaced by another; for a GGUF served in place, SourceChanged naming the GGUF."""
    now = f.stamp()
    if now != stamp:
        raise OSError(
            f"the file changed on the host after the session described it (size, mtime_ns, inode: "
            f"{stamp} -> {now}); restart the host to serve the new contents"
        )
    return f.pread(offset, length)
