"""One member's part in moving a session's weights: the sources it fetches from, what it serves
to the others, and the replicas it keeps (kafila.session.weights.peers, .mirror, .replicas).

    sharing = Sharing(cache, mirror_url, replica_bytes)
    sharing.attach(links)                       # serve what it holds on every link, from now on
    shard = await fetch_shard(host_channel, blocks, head, sources=sharing.sources(links, host),
                              on_manifest=sharing.known)
    sharing.keep_replicas(plan, me, links, host)   # in the background, after its own shard

The host serves its checkpoint folder the same way (`await sharing.host_folder(server)`), so a
member can fetch ranges from it at any time, not only while a plan is being formed.
`ranges_from(links, host)` is the answer to "where can a block range come from": the readers, in
the order a fetch asks them.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from kafila.net.link import Link
from kafila.obs.log import get_logger
from kafila.planner.plan import Plan
from kafila.session.weights.cache import cache_root
from kafila.session.weights.fetch import Kept, ShardResult, fetch_tensors
from kafila.session.weights.holding import remember
from kafila.session.weights.manifest import WeightManifest, WeightsError
from kafila.session.weights.mirror import MirrorReader
from kafila.session.weights.peers import FolderFiles, HeldFiles, PeerReader, PeerServer
from kafila.session.weights.replicas import DEFAULT_REPLICA_BYTES, replica_names
from kafila.session.weights.server import WeightServer
from kafila.session.weights.sources import Reader

log = get_logger("kafila.session.weights")
REPLICA_WINDOW = 2  # requests in flight for replicas: they wait behind the ring's own traffic


class Sharing:
    def __init__(
        self, cache: Path | None = None, mirror: str | None = None, replica_bytes: int = DEFAULT_REPLICA_BYTES
    ) -> None:
        self.root = cache_root(cache)
        self.mirror, self.replica_bytes = mirror, replica_bytes
        self.server = PeerServer()
        self.manifest: WeightManifest | None = None
        self.replicas: asyncio.Task[Kept | None] | None = None
        self.whole: Path | None = None  # a folder of this member's holding the whole checkpoint
        self.folders: list[WeightServer] = []  # the servers of folders it serves: their files close with it

    def known(self, m: WeightManifest) -> None:
        """The checkpoint's manifest came: serve what this member's cache holds of it, and keep
        the manifest, from which a later join reports what it holds (kafila.session.weights.holding)."""
        if self.manifest is None:
            self.manifest = m
            self.server.serve(HeldFiles(self.root, m))
            remember(self.root, m)

    async def host_folder(self, server: WeightServer) -> None:
        """The host: serve its checkpoint folder (everything the manifest names)."""
        self.folders.append(server)
        m = await server.prepare()
        if self.manifest is None:
            self.manifest = m
            self.server.serve(FolderFiles(server, m))

    def local_copy(self, folder: Path) -> None:
        """This member loads its own copy of the checkpoint: keep no replicas, and serve all of it
        once described, when another member first asks (on a thread: tensors not hashed before are
        hashed once, a cost no session pays unless a member fetches from this one)."""
        self.whole = folder

        async def describe() -> None:
            server = WeightServer(folder, cache=self.root)
            self.folders.append(server)
            try:
                m = await server.prepare()
            except (OSError, ValueError) as exc:
                log.warning("weights_local_not_served", folder=str(folder), error=str(exc))
                return
            if self.manifest is not None and m.checkpoint == self.manifest.checkpoint:
                self.server.serve(FolderFiles(server, m))

        self.server.first_ask = describe

    def attach(self, links: dict[str, Link]) -> None:
        self.server.attach(links)

    def sources(self, links: dict[str, Link], host: str) -> list[Reader]:
        """What a shard fetch asks before the host (at the other end of its channel): every other
        member this member has a link with, then the mirror."""
        readers: list[Reader] = [
            PeerReader(link, peer) for peer, link in sorted(links.items()) if peer != host
        ]
        if self.mirror:
            readers.append(MirrorReader(self.mirror))
        return readers

    def ranges_from(self, links: dict[str, Link], host: str) -> list[Reader]:
        """Every source of block ranges, in order: members, the mirror, then the host over the
        same link protocol (it serves its folder at any time, not only while forming)."""
        readers = self.sources(links, host)
        if host in links:
            readers.append(PeerReader(links[host], host, kind="host"))
        return readers

    def keep_replicas(self, plan: Plan, me: str, links: dict[str, Link], host: str) -> None:
        """Fetch, in the background, the next member's shard into the blob cache (within the
        bound); a later plan's call replaces an unfinished one."""
        if self.replicas is not None and not self.replicas.done():
            self.replicas.cancel()
        if self.manifest is None or me == host or self.whole is not None:  # it holds the whole model
            return
        names = replica_names(self.manifest, plan, me, self.replica_bytes)
        if names:
            readers = [
                PeerReader(r.link, r.peer, window=REPLICA_WINDOW, kind=r.kind)
                if isinstance(r, PeerReader)
                else r
                for r in self.ranges_from(links, host)
            ]
            self.replicas = asyncio.ensure_future(
                self._keep(self.manifest, names, readers, plan.successor(me))
            )

    async def _keep(self, m: WeightManifest, names: list[str], readers: list[Reader], of: str) -> Kept | None:
        try:
            kept = await fetch_tensors(m, names, readers, self.root)
        except (WeightsError, OSError) as exc:
            log.warning("weights_replicas_failed", of=of, tensors=len(names), error=str(exc))
            return None
        log.info(
            "weights_replicas",
            of=of,
            tensors=len(names),
            fetched=len(kept.tensors),
            bytes=sum(m.tensors[n].nbytes for n in names),
            sources=kept.sources,
        )
        return kept

    async def close(self) -> None:
        for task in (self.replicas, self.server.warming):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for server in self.folders:  # a range still being read closes them when it is done
            server.close()


def where_from(shard: ShardResult) -> str:
    """Where a shard's fetched bytes came from: "the host", or each kind's share ("peers 12.0 MB,
    the host 0.3 MB")."""
    kinds = {k: n for k, n in shard.kinds.items() if n}
    if set(kinds) <= {"host"}:
        return "the host"
    said = {"peer": "peers", "mirror": "the mirror", "host": "the host"}
    return ", ".join(f"{said.get(k, k)} {n / 1e6:.1f} MB" for k, n in sorted(kinds.items()))
