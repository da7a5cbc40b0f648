"""Members serve each other the checkpoint ranges they hold, over their authenticated links.

A member that fetched its shard holds tensors in its blob cache (its own shard, the replicas of
kafila.session.weights.replicas, whatever earlier plans gave it) and the checkpoint's headers and
small files. `PeerServer` answers, on every link it is attached to, the same requests the host's
WeightServer answers (a FetchRequest in the checkpoint's own file offsets), for bytes it holds only;
`PeerReader` is the asking side, one source among those of kafila.session.weights.fetch.

Two link message kinds of their own (the ring's channel is 32, the epoch messages 33), so a peer's
fetch never mixes with ring traffic and needs no plan epoch:

    asker -> holder   REQUEST_KIND  Control weights.have {checkpoint, ask}    what do you hold?
    holder -> asker   REPLY_KIND    Control weights.held {ask, tensors, files}
    asker -> holder   REQUEST_KIND  FetchRequest {fetch_id, file, offset, length}
    holder -> asker   REPLY_KIND    FetchData | Error {request_id: fetch_id}

The asker checks every tensor against the host's manifest like any source's bytes.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import os
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kafila.net.errors import LinkError
from kafila.net.link import Link
from kafila.net.waits import wait_at_most
from kafila.obs.log import get_logger
from kafila.proto import tensor as t
from kafila.session.channel import ChannelClosed, ChannelDead, Counters
from kafila.session.weights.cache import BlobStore, one_tensor_header
from kafila.session.weights.manifest import FetchRefused, TensorEntry, WeightManifest, WeightsError
from kafila.session.weights.server import WeightServer
from kafila.session.weights.sources import ChannelReader, Job, Sink

log = get_logger("kafila.session.weights")

REQUEST_KIND = 35
REPLY_KIND = 36
OP_HAVE = "weights.have"
OP_HELD = "weights.held"
# how long to wait for each ask of "what do you hold": a peer that links as this member does may
# attach its server a moment later, then answers once it has the manifest (asked of the host as
# this member asks it)
HAVE_WAITS_S = (1.0, 2.0, 20.0)
# A member that does not know the checkpoint yet (its manifest has not come) answers "nothing held"
# after this, so a member asking it takes the range elsewhere rather than waiting on it.
STORE_WAIT_S = 5.0
_ASKS = itertools.count(1)


@dataclass
class Holding:
    """What one member holds of a checkpoint, on disk and checked: tensor names, small files and
    the headers it can serve (`<file>.header`)."""

    tensors: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)


class Store(Protocol):
    """What a member can serve of checkpoint `m` (blocking methods: run on a thread)."""

    m: WeightManifest

    def refresh(self) -> Holding: ...

    def read(self, file: str, offset: int, length: int) -> bytes: ...


class FolderFiles:
    """The host's checkpoint folder, served through its WeightServer's checks (everything it offers)."""

    def __init__(self, server: WeightServer, m: WeightManifest) -> None:
        self.server, self.m = server, m

    def refresh(self) -> Holding:
        return Holding(set(self.m.tensors), {*self.m.files, *(f"{k}.header" for k in self.m.headers)})

    def read(self, file: str, offset: int, length: int) -> bytes:
        return self.server.read_range(file, offset, length)


class HeldFiles:
    """A member's cache as ranges of the checkpoint's files (blobs under `cache/blobs`, headers and
    small files under `cache/weights/<ckpt16>/files`), for checkpoint `m`."""

    def __init__(self, cache: Path, m: WeightManifest) -> None:
        self.m, self.blobs = m, BlobStore(cache / "blobs")
        self.files_dir = cache / "weights" / m.checkpoint[:16] / "files"
        self.holding = Holding()
        self._by_file: dict[str, list[TensorEntry]] = {}
        for e in m.tensors.values():
            self._by_file.setdefault(e.file, []).append(e)
        for es in self._by_file.values():
            es.sort(key=lambda e: e.start)

    def refresh(self) -> Holding:
        """Look at what is on disk now (blocking: a blob changed since it was stored is hashed)."""
        tensors = {
            e.name
            for e in self.m.tensors.values()
            if self.blobs.has(e.key, e.name, e.dtype, e.shape, e.nbytes, e.sha256)
        }
        wanted = [*self.m.files, *(f"{k}.header" for k in self.m.headers)]
        files = {n for n in wanted if (self.files_dir / n).is_file()}
        self.holding = Holding(tensors, files)
        return self.holding

    def read(self, file: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of the checkpoint's `file`, from what this member holds
        (FetchRefused when it does not hold all of them). Blocking."""
        a, b = offset, offset + length
        if file in self.m.files:
            return self._slice(self.files_dir / file, file, a, b, 0)
        if file in self.m.headers and b <= self.m.headers[file]:
            return self._slice(self.files_dir / f"{file}.header", f"{file}.header", a, b, 0)
        es = self._by_file.get(file, [])
        i = max(0, bisect.bisect_right([e.start for e in es], a) - 1)
        parts, at = [], a
        while at < b and i < len(es) and es[i].start <= at < es[i].end:
            e = es[i]
            if e.name not in self.holding.tensors:
                break
            hi = min(b, e.end)
            skip = len(one_tensor_header(e.name, e.dtype, e.shape, e.nbytes))
            parts.append(self._slice(self.blobs.path(e.key), e.name, at - e.start, hi - e.start, skip))
            at, i = hi, i + 1
        if at < b:
            raise FetchRefused(f"{file}: bytes [{at}, {b}) are not held by this member")
        return b"".join(parts)

    def _slice(self, path: Path, name: str, a: int, b: int, skip: int) -> bytes:
        if (name.endswith(".header") or name in self.m.files) and name not in self.holding.files:
            raise FetchRefused(f"{name} is not held by this member")
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.pread(fd, b - a, skip + a)
        finally:
            os.close(fd)
        if len(data) != b - a:
            raise FetchRefused(f"{name}: bytes [{a}, {b}) are past the end of the held copy")
        return data


class PeerServer:
    """Serves a Store to every link attached (answers run off the loop, one task per request). The
    store comes once this member knows the checkpoint (its manifest): a question asked before waits
    for it, up to `wait_s`."""

    def __init__(self, wait_s: float = STORE_WAIT_S) -> None:
        self.store: asyncio.Future[Store] = asyncio.get_running_loop().create_future()
        self.current: Store | None = None
        self.wait_s = wait_s
        self.first_ask: Callable[[], Awaitable[None]] | None = None  # work put off until someone asks
        self.warming: asyncio.Task[None] | None = None
        self.bytes_sent: dict[str, int] = {}
        self.on_asked: Callable[[str], None] | None = None  # told the peer of every request it hears
        self._tasks: set[asyncio.Task[None]] = set()

    def serve(self, store: Store) -> None:
        """Serve `store` from now on (one checkpoint per session: a later store holds more of it)."""
        self.current = store
        if not self.store.done():
            self.store.set_result(store)

    def attach(self, links: dict[str, Link]) -> None:
        for peer, link in links.items():
            link.handlers[REQUEST_KIND] = self._heard(link, peer)

    def _heard(self, link: Link, peer: str) -> Callable[[bytes], None]:
        def heard(payload: bytes) -> None:
            try:
                msg = t.decode(payload)
            except t.FrameError as exc:
                log.warning("weights_peer_message_ignored", peer=peer, reason=str(exc))
                return
            if self.on_asked is not None:  # a sign of life of the peer (a successor at work)
                self.on_asked(peer)
            task = asyncio.ensure_future(self._answer(link, peer, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return heard

    async def _answer(self, link: Link, peer: str, msg: t.Message) -> None:
        reply: t.Message
        try:
            await wait_at_most(asyncio.shield(self.store), self.wait_s)
        except TimeoutError:
            log.info("weights_peer_not_ready", peer=peer, waited_s=self.wait_s)
            await _reply(link, peer, _not_ready(msg, self.wait_s))
            return
        if self.first_ask is not None:
            if self.warming is None:
                self.warming = asyncio.ensure_future(self.first_ask())
            await asyncio.shield(self.warming)
        held = self.current
        assert held is not None
        if isinstance(msg, t.Control) and msg.op == OP_HAVE:
            mine = msg.body.get("checkpoint") == held.m.checkpoint
            holding = await asyncio.to_thread(held.refresh) if mine else Holding()
            body = {
                "ask": msg.body.get("ask"),
                "tensors": sorted(holding.tensors),
                "files": sorted(holding.files),
            }
            reply = t.Control(OP_HELD, body)
        elif isinstance(msg, t.FetchRequest):
            try:
                if msg.length > held.m.max_request:
                    raise FetchRefused(f"request of {msg.length} bytes; at most {held.m.max_request}")
                data = await asyncio.to_thread(held.read, msg.file, msg.offset, msg.length)
                reply = t.FetchData(msg.fetch_id, data)
                self.bytes_sent[peer] = self.bytes_sent.get(peer, 0) + len(data)
            except (FetchRefused, OSError) as exc:
                reply = t.Error(msg.fetch_id, "fetch_refused", str(exc))
        else:
            return
        await _reply(link, peer, reply)


def _not_ready(msg: t.Message, waited_s: float) -> t.Message | None:
    """The answer of a member that does not know the checkpoint yet: it holds nothing of it."""
    if isinstance(msg, t.Control) and msg.op == OP_HAVE:
        return t.Control(OP_HELD, {"ask": msg.body.get("ask"), "tensors": [], "files": []})
    if isinstance(msg, t.FetchRequest):
        return t.Error(msg.fetch_id, "fetch_refused", f"no manifest of the checkpoint after {waited_s:g} s")
    return None


async def _reply(link: Link, peer: str, reply: t.Message | None) -> None:
    if reply is None:
        return
    try:
        await link.send(REPLY_KIND, t.encode(reply, 0))
    except LinkError as exc:
        log.info("weights_peer_gone", peer=peer, error=str(exc))


class _Replies:
    """The REPLY_KIND answers on one link, routed to the reader that asked (by fetch or ask id)."""

    def __init__(self, link: Link) -> None:
        self.waiting: dict[int, asyncio.Queue[t.Message]] = {}
        self.asks: dict[int, asyncio.Queue[t.Message]] = {}
        link.handlers[REPLY_KIND] = self.heard

    def heard(self, payload: bytes) -> None:
        try:
            msg = t.decode(payload)
        except t.FrameError:
            return
        if isinstance(msg, t.FetchData):
            queue = self.waiting.pop(msg.fetch_id, None)
        elif isinstance(msg, t.Error):
            queue = self.waiting.pop(msg.request_id, None)
        elif isinstance(msg, t.Control) and isinstance(ask := msg.body.get("ask"), int):
            queue = self.asks.get(ask)
        else:
            queue = None
        if queue is not None:
            queue.put_nowait(msg)


_REPLIES: weakref.WeakKeyDictionary[Link, _Replies] = weakref.WeakKeyDictionary()


def _replies(link: Link) -> _Replies:
    if (r := _REPLIES.get(link)) is None or link.handlers.get(REPLY_KIND) != r.heard:
        r = _REPLIES[link] = _Replies(link)
    return r


class _PeerChannel:
    """The asking side of one link as the session Channel a ChannelReader reads."""

    def __init__(self, link: Link, peer: str) -> None:
        self.link, self.peer, self.counters = link, peer, Counters()
        self.replies = _replies(link)
        self.inbox: asyncio.Queue[t.Message] = asyncio.Queue()

    async def send(self, msg: t.Message) -> None:
        if isinstance(msg, t.FetchRequest):
            self.replies.waiting[msg.fetch_id] = self.inbox
        try:
            await self.link.send(REQUEST_KIND, t.encode(msg, 0))
        except LinkError as exc:
            raise ChannelClosed(f"link to {self.peer}: {exc}", self.peer) from exc

    async def recv(self, timeout: float | None = None) -> t.Message:
        try:
            return await wait_at_most(self.inbox.get(), timeout)
        except TimeoutError:
            raise ChannelDead(f"{self.peer}: no answer within {timeout} s", self.peer) from None


class PeerReader:
    """Ranges from another member over the link between them: what it says it holds, only."""

    def __init__(
        self, link: Link, peer: str, window: int = 8, timeout: float = 30.0, kind: str = "peer"
    ) -> None:
        self.link, self.peer, self.window, self.timeout = link, peer, window, timeout
        self.kind, self.name = kind, f"{kind} {peer}"
        self.max_request = 1
        self.holding = Holding()
        self._spans: dict[str, list[tuple[int, int]]] = {}

    async def prepare(self, m: WeightManifest) -> bool:
        self.max_request = m.max_request
        channel = _PeerChannel(self.link, self.peer)
        ask = next(_ASKS)
        channel.replies.asks[ask] = channel.inbox
        try:
            for wait in HAVE_WAITS_S:
                await channel.send(t.Control(OP_HAVE, {"checkpoint": m.checkpoint, "ask": ask}))
                try:
                    msg = await channel.recv(wait)
                except ChannelDead:
                    continue
                if isinstance(msg, t.Control) and msg.op == OP_HELD:
                    return self._held(m, msg.body)
        except ChannelClosed as exc:
            raise WeightsError(f"{self.name}: {exc}") from exc
        finally:
            channel.replies.asks.pop(ask, None)
        log.info("weights_peer_silent", peer=self.peer, waited_s=sum(HAVE_WAITS_S))
        return False

    def _held(self, m: WeightManifest, body: dict[str, object]) -> bool:
        tensors, files = body.get("tensors"), body.get("files")
        names = {str(n) for n in tensors} if isinstance(tensors, list) else set()
        held = {str(n) for n in files} if isinstance(files, list) else set()
        self.holding = Holding({n for n in names if n in m.tensors}, held)
        spans: dict[str, list[tuple[int, int]]] = {}
        for n in self.holding.tensors:
            e = m.tensors[n]
            spans.setdefault(e.file, []).append((e.start, e.end))
        self._spans = {f: sorted(s) for f, s in spans.items()}
        return bool(self.holding.tensors or self.holding.files)

    def offers(self, file: str, start: int, end: int) -> bool:
        if file in self.holding.files or (f"{file}.header" in self.holding.files and start < 8):
            return True
        spans = self._spans.get(file, [])
        i = bisect.bisect_right(spans, (start, end)) - 1
        return i >= 0 and spans[i][0] <= start and end <= spans[i][1]

    async def run(self, jobs: list[Job], sink: Sink) -> None:
        channel = _PeerChannel(self.link, self.peer)
        reader = ChannelReader(channel, self.kind, self.window, self.timeout, self.max_request)
        reader.name = self.name
        await reader.run(jobs, sink)
