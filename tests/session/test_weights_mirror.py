"""Weights from an HTTP mirror laid out like the Hugging Face hub (kafila.session.weights.mirror):
ranged GETs with a token, checked against the host's manifest, a corrupt range refetched elsewhere."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kafila.models.checkpoint import Checkpoint
from kafila.session.channel import MemoryChannel
from kafila.session.weights.fetch import ShardResult, fetch_shard
from kafila.session.weights.manifest import checkpoint_id
from kafila.session.weights.mirror import (
    MirrorReader,
    fetch_checkpoint,
    mirror_base,
    missing_files,
    needs_fetching,
)
from kafila.session.weights.server import WeightServer
from kafila.session.weights.sources import Paced, Reader
from tests.session.hubserver import Hub, serving

MODEL = "llama-mha-untied"


@pytest.fixture(scope="module")
def folder(tiny_checkpoint) -> Path:
    return tiny_checkpoint(MODEL, sharded=True)


async def fetch(
    folder: Path, tmp: Path, blocks: range, head: bool, sources: list[Reader]
) -> tuple[ShardResult, WeightServer]:
    server = WeightServer(folder, cache=tmp / "host")
    member, host = MemoryChannel.pair("host", "m1")[::-1]
    serving_task = asyncio.ensure_future(server.serve(host, timeout=30))
    try:
        shard = await fetch_shard(
            member, blocks, head, cache=tmp / "m1", local=[], progress=False, sources=sources
        )
    finally:
        await asyncio.wait_for(serving_task, 10)
    return shard, server


def same_tensors(shard: Path, folder: Path, names: list[str]) -> None:
    got, full = Checkpoint.open(shard), Checkpoint.open(folder)
    for name in names:
        assert bytes(got.read([name])[name][1]) == bytes(full.read([name])[name][1]), name


def test_a_hub_page_url_means_its_resolve_main_urls() -> None:
    assert mirror_base("https://huggingface.co/Qwen/Qwen3-0.6B") == (
        "https://huggingface.co/Qwen/Qwen3-0.6B/resolve/main"
    )
    pinned = "https://huggingface.co/Qwen/Qwen3-0.6B/resolve/abc123"
    assert mirror_base(pinned + "/") == pinned
    assert mirror_base("http://mirror.lan:8080/models/qwen") == "http://mirror.lan:8080/models/qwen"
    with pytest.raises(ValueError, match="not an http"):
        mirror_base("/srv/models/qwen")


async def test_member_fetches_its_whole_shard_from_a_hub_layout_mirror_with_a_token(
    folder, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    with serving(Hub(folder, token="hf_secret")) as hub:
        shard, server = await fetch(folder, tmp_path, range(1, 3), True, [MirrorReader(hub.url)])
    names = Checkpoint.open(folder).names_for(range(1, 3), True)
    assert sorted(shard.fetched) == sorted(names)
    assert shard.kinds == {"mirror": shard.bytes_fetched}  # every byte, headers and files too
    assert sum(hub.served.values()) >= shard.bytes_fetched
    assert server.stats.get("m1") is None or server.stats["m1"].bytes_sent == 0  # nothing from the host
    assert hub.refused == 1  # asked once without the token (not a hub host), then always with it
    same_tensors(shard.path, folder, names)


async def test_simulated_corruption_on_the_mirror_is_refetched_from_the_host(folder, tmp_path) -> None:
    full = Checkpoint.open(folder)
    names = full.names_for(range(0, 2), False)
    victim = max((full.tensors[n] for n in names), key=lambda i: i.nbytes)
    with serving(Hub(folder, flip=(victim.file.name, victim.start + victim.nbytes // 2))) as hub:
        shard, server = await fetch(folder, tmp_path, range(0, 2), False, [MirrorReader(hub.url)])
    # the damaged tensor alone came from the host; nothing damaged reached the cache
    assert server.stats["m1"].bytes_sent == victim.nbytes
    assert shard.kinds["host"] == victim.nbytes
    assert shard.kinds["mirror"] >= sum(full.tensors[n].nbytes for n in names)
    same_tensors(shard.path, folder, names)


async def test_tensors_written_as_their_ranges_arrive_from_a_mirrors_parallel_requests_are_whole(
    folder, tmp_path, monkeypatch
) -> None:
    """A mirror answers `window` ranged GETs side by side, so several ranges of one tensor reach
    the fetch at once: with every tensor written to its blob file as it arrives (SPOOL_BYTES 1,
    1 KiB requests), each blob is still made once and whole, and no part file is left."""
    from kafila.session.weights import fetch as fetching

    monkeypatch.setattr(fetching, "SPOOL_BYTES", 1)
    names = Checkpoint.open(folder).names_for(range(0, 3), True)
    with serving(Hub(folder)) as hub:
        reader = MirrorReader(hub.url, window=8, max_request=1024)
        shard, _ = await fetch(folder, tmp_path, range(0, 3), True, [reader])
    assert sorted(shard.fetched) == sorted(names) and shard.kinds == {"mirror": shard.bytes_fetched}
    assert not list((tmp_path / "m1").rglob("*.part"))
    same_tensors(shard.path, folder, names)


async def test_a_simulated_slow_source_spreads_its_answers_over_the_seconds_given(folder, tmp_path) -> None:
    """Paced (a slow disk or uplink at a source, simulated for tests): the same checked bytes from
    the same source, no sooner than the seconds given."""
    names = Checkpoint.open(folder).names_for(range(0, 2), True)
    loop = asyncio.get_running_loop()
    with serving(Hub(folder)) as hub:
        started = loop.time()
        reader = Paced(MirrorReader(hub.url), 3.0)  # the same fetch unpaced takes under a second
        shard, _ = await fetch(folder, tmp_path, range(0, 2), True, [reader])
        took = loop.time() - started
    assert took >= 3.0, took
    assert sorted(shard.fetched) == sorted(names) and shard.kinds == {"mirror": shard.bytes_fetched}
    same_tensors(shard.path, folder, names)


async def test_a_mirror_that_wants_a_token_none_has_is_skipped_for_the_host(
    folder, tmp_path, monkeypatch
) -> None:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with serving(Hub(folder, token="hf_secret")) as hub:
        shard, server = await fetch(folder, tmp_path, range(0, 1), False, [MirrorReader(hub.url)])
    assert set(shard.kinds) == {"host"} and server.stats["m1"].bytes_sent == shard.bytes_fetched
    assert hub.refused == 1  # the header check before any tensor, then no more asking


async def test_a_mirror_of_another_checkpoint_is_skipped_before_any_tensor(
    folder, tiny_checkpoint, tmp_path
) -> None:
    other = tiny_checkpoint("llama-gqa3-tied", sharded=True)
    with serving(Hub(other)) as hub:
        shard, _ = await fetch(folder, tmp_path, range(0, 2), False, [MirrorReader(hub.url)])
        lacking = await missing_files(hub.url, ["config.json", "model.safetensors.index.json", "nope.bin"])
    assert set(shard.kinds) == {"host"}
    assert sum(hub.served.values()) <= 8 * len(Checkpoint.open(other).tensors)  # header lengths only
    assert lacking == ["nope.bin"]


async def test_a_host_starting_from_a_mirror_fetches_the_same_checkpoint_once(
    folder, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    with serving(Hub(folder, token="hf_secret")) as hub:
        got = await fetch_checkpoint(hub.url, tmp_path / "models" / "tiny")
        first = sum(hub.served.values())
        again = await fetch_checkpoint(hub.url, tmp_path / "models" / "tiny")
        assert again == got and sum(hub.served.values()) == first  # finished before: nothing fetched
    assert checkpoint_id(got) == checkpoint_id(folder)
    full = Checkpoint.open(folder)
    same_tensors(got, folder, list(full.tensors))
    assert needs_fetching("tiny") and not needs_fetching(str(folder)) and not needs_fetching("smollm2-135m")
