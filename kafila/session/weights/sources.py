"""Where a checkpoint byte range can come from, and reading ranges from one such source.

A member fetches its shard from sources in order (kafila.session.weights.fetch): its own cache,
then members that hold the range (kafila.session.weights.peers), then an HTTP(S) mirror or the
Hugging Face hub (kafila.session.weights.mirror), then the host. Every source reads ranges of the
checkpoint's own files (`file`, absolute `offset`, `length`), so a range means the same bytes
wherever it comes from, and the member checks each tensor against the manifest's sha256 (the host
computed it) whatever source sent it: a corrupt or truncated range goes to the next source.

    reader = ChannelReader(channel, "host", window=8, timeout=30.0)
    await reader.run(jobs, sink)        # sink(job, data) per answered job, in any order
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from kafila.obs.log import get_logger
from kafila.proto import tensor as t
from kafila.session.channel import ChannelError
from kafila.session.weights.manifest import U32_MAX, WeightManifest, WeightsError, runs

log = get_logger("kafila.session.weights")

# where a range came from, as ShardResult.by_kind and the kafila_weight_fetched_bytes counter say it
SOURCE_KINDS = ("peer", "mirror", "host")

_FETCH_IDS = itertools.count()


@dataclass
class Job:
    """One ranged read: bytes [offset, offset + length) of the checkpoint's file `file`."""

    file: str
    offset: int
    length: int


Sink = Callable[[Job, bytes], Awaitable[None]]


class Asking(Protocol):
    """The part of a session Channel a ChannelReader uses."""

    peer: str

    async def send(self, msg: t.Message) -> None: ...

    async def recv(self, timeout: float | None = None) -> t.Message: ...


class Reader(Protocol):
    """One source of checkpoint bytes. `run` raises WeightsError when the source fails (refused,
    gone, a response of the wrong size); what it handed to `sink` before stays valid to check."""

    name: str  # for logs and errors: "host h0", "peer m1", "mirror https://..."
    kind: str  # one of SOURCE_KINDS
    max_request: int  # bytes per job this source takes

    async def prepare(self, m: WeightManifest) -> bool:
        """Learn what it holds of the checkpoint `m` describes; False: it has nothing to offer."""
        ...

    def offers(self, file: str, start: int, end: int) -> bool:
        """Whether to ask this source for bytes [start, end) of `file` (after `prepare`)."""
        ...

    async def run(self, jobs: list[Job], sink: Sink) -> None: ...


def chunks(file: str, spans: list[tuple[int, int]], max_request: int) -> list[Job]:
    """Jobs of at most `max_request` bytes covering `spans` of `file` (touching spans merged)."""
    jobs = []
    for a, b in runs(spans):
        jobs += [Job(file, o, min(max_request, b - o)) for o in range(a, b, max_request)]
    return jobs


class ChannelReader:
    """Ranges over a session channel (the weight protocol of kafila.session.weights.manifest): the
    host at the other end of a member's control link, or a member serving what it holds."""

    def __init__(
        self,
        channel: Asking,
        kind: str,
        window: int,
        timeout: float,
        max_request: int,
        offered: Callable[[str, int, int], bool] | None = None,
    ) -> None:
        self.channel, self.kind, self.window, self.timeout = channel, kind, window, timeout
        self.name = f"{kind} {channel.peer}"
        self.max_request = max_request
        self._offered = offered

    async def prepare(self, m: WeightManifest) -> bool:
        return True

    def offers(self, file: str, start: int, end: int) -> bool:
        return self._offered is None or self._offered(file, start, end)

    async def run(self, jobs: list[Job], sink: Sink) -> None:
        """Fetch every job with up to `window` requests in flight; `sink(job, data)` takes each."""
        queue = list(reversed(jobs))
        pending: dict[int, Job] = {}
        while queue or pending:
            while queue and len(pending) < self.window:
                job = queue.pop()
                fid = next(_FETCH_IDS) % U32_MAX + 1  # unique in this process: stale answers are known
                pending[fid] = job
                try:
                    await self.channel.send(t.FetchRequest(fid, job.file, job.offset, job.length))
                except ChannelError as exc:
                    raise WeightsError(f"weights fetch from {self.name}: {exc}") from exc
            try:
                msg = await self.channel.recv(self.timeout)
            except ChannelError as exc:
                raise WeightsError(f"weights fetch from {self.name}: {exc}") from exc
            if isinstance(msg, t.Error) and msg.request_id in pending:
                job = pending[msg.request_id]
                raise WeightsError(
                    f"{self.name} refused {job.file} bytes [{job.offset}, "
                    f"{job.offset + job.length}): {msg.code}: {msg.message}"
                )
            if isinstance(msg, t.Error) and msg.request_id == 0:  # the link or session failed
                raise WeightsError(f"{self.name}: {msg.code}: {msg.message}")
            if not isinstance(msg, t.FetchData):
                log.debug("weights_ignored_message", kind=msg.kind.name)
                continue
            if msg.fetch_id not in pending:  # an answer to an earlier, abandoned fetch on this channel
                log.debug("weights_stale_answer", fetch_id=msg.fetch_id)
                continue
            job = pending.pop(msg.fetch_id)
            if len(msg.data) != job.length:
                raise WeightsError(
                    f"{job.file} bytes [{job.offset}, {job.offset + job.length}): {self.name} "
                    f"sent {len(msg.data)} bytes for a {job.length}-byte request (truncated or corrupt "
                    f"response); nothing from it was cached"
                )
            await sink(job, msg.data)


class Paced:
    """A source whose answers to each `run` are spread over at least `seconds`, in proportion to
    their bytes: a slow disk or uplink at the other end, simulated (for tests, never by default)."""

    def __init__(self, inner: Reader, seconds: float) -> None:
        self.inner, self.seconds = inner, seconds
        self.name, self.kind = inner.name, inner.kind

    @property
    def max_request(self) -> int:  # a source learns it in `prepare`
        return self.inner.max_request

    @max_request.setter
    def max_request(self, value: int) -> None:
        self.inner.max_request = value

    async def prepare(self, m: WeightManifest) -> bool:
        return await self.inner.prepare(m)

    def offers(self, file: str, start: int, end: int) -> bool:
        return self.inner.offers(file, start, end)

    async def run(self, jobs: list[Job], sink: Sink) -> None:
        loop = asyncio.get_running_loop()
        start, total, done = loop.time(), max(1, sum(j.length for j in jobs)), 0

        async def paced(job: Job, data: bytes) -> None:
            nonlocal done
            done += job.length
            await asyncio.sleep(max(0.0, start + self.seconds * done / total - loop.time()))
            await sink(job, data)

        await self.inner.run(jobs, paced)
