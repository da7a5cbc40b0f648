"""What a member's weight cache holds of a checkpoint, for its join report
(kafila.session.weights.holding), after real fetches from a host's WeightServer."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kafila.planner.held import Held
from kafila.session.channel import MemoryChannel
from kafila.session.weights.cache import BlobStore
from kafila.session.weights.fetch import ShardResult, fetch_shard
from kafila.session.weights.holding import held_in_cache, manifest_path, remember
from kafila.session.weights.server import WeightServer


async def _fetch(server: WeightServer, cache: Path, blocks: range, head: bool) -> ShardResult:
    member, host_end = MemoryChannel.pair("host", "m1")[::-1]
    serving = asyncio.ensure_future(server.serve(host_end, timeout=30))
    try:
        return await fetch_shard(
            member,
            blocks,
            head,
            cache=cache,
            local=[],
            progress=False,
            on_manifest=lambda m: remember(cache, m),
        )
    finally:
        await asyncio.wait_for(serving, 10)


async def test_a_cache_reports_the_blocks_it_holds_in_full_and_the_head(tiny_checkpoint, tmp_path) -> None:
    folder = tiny_checkpoint("llama-mha-untied", sharded=True)
    server = WeightServer(folder, cache=tmp_path / "host")
    cache = tmp_path / "m1"
    got = await _fetch(server, cache, range(0, 2), True)
    m = got.manifest
    assert m is not None
    assert held_in_cache(cache, m.checkpoint) == Held(frozenset({0, 1}), True)
    await _fetch(server, cache, range(3, 5), False)  # a later plan's share adds to it
    assert held_in_cache(cache, m.checkpoint) == Held(frozenset({0, 1, 3, 4}), True)
    # a block one of whose tensors was removed from the cache is not held in full
    gone = next(e for e in m.tensors.values() if e.name.startswith("model.layers.3."))
    BlobStore(cache / "blobs").path(gone.key).unlink()
    assert held_in_cache(cache, m.checkpoint) == Held(frozenset({0, 1, 4}), True)
    # nothing for another checkpoint, an empty cache, or a manifest that does not read
    assert held_in_cache(cache, "0" * 64) == Held()
    assert held_in_cache(tmp_path / "empty", m.checkpoint) == Held()
    assert held_in_cache(cache, None) == Held()
    manifest_path(cache, m.checkpoint).write_text("{not json")
    assert held_in_cache(cache, m.checkpoint) == Held()
