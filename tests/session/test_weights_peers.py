"""Weights from the members that hold them (kafila.session.weights.peers, .replicas, .sharing) in
whole sessions on loopback: a real rendezvous, QUIC links, members in this process."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kafila.api.service import Sampling
from kafila.engine.tokenizer import Tokenizer
from kafila.models.checkpoint import Checkpoint
from kafila.models.manifest import block_index, stage_tensors
from kafila.planner.held import Held
from kafila.rendezvous.server import RendezvousServer
from kafila.session.forming.host import host
from kafila.session.forming.join import join
from kafila.session.runtime import MemberRuntime
from kafila.session.terms import Options
from kafila.session.weights.cache import BlobStore
from kafila.session.weights.holding import held_in_cache
from kafila.session.weights.manifest import WeightManifest
from tests.session.conftest import make_tiny_chat
from tests.session.hosting import code_of

pytestmark = [pytest.mark.network, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    return make_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), smollm2_tokenizer, blocks=6)


def opts(rdv: RendezvousServer, name: str, tmp: Path, **kw) -> Options:
    base = dict(
        rendezvous=rdv.url, name=name, api="127.0.0.1:0", cache=tmp / name, probe_repeats=1, wait_s=60
    )
    return Options(**(base | kw))


async def form(rdv: RendezvousServer, tmp: Path, model: Path, joiners: list[str]) -> list[MemberRuntime]:
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    host_opts = opts(rdv, "alpha", tmp, model=str(model), members=1 + len(joiners), context=256, chunk=64)
    hosting = asyncio.ensure_future(host(host_opts, on_code=code.set_result))
    c = await code_of(code, hosting)
    members = [asyncio.ensure_future(join(c, opts(rdv, n, tmp, use_local=False))) for n in joiners]
    return list(await asyncio.gather(hosting, *members))


async def replicas_kept(formed: list[MemberRuntime]) -> None:
    for f in formed:
        if f.weights is not None and f.weights.replicas is not None:
            assert await asyncio.wait_for(f.weights.replicas, 60) is not None, f"{f.name}'s replicas failed"


def held(member: MemberRuntime, m: WeightManifest) -> set[str]:
    blobs = BlobStore(member.weights.root / "blobs")  # type: ignore[union-attr]
    return {
        e.name for e in m.tensors.values() if blobs.has(e.key, e.name, e.dtype, e.shape, e.nbytes, e.sha256)
    }


async def answers(formed: list[MemberRuntime], prompt: list[int]) -> list[int]:
    member = next(f for f in formed if f.plan.head != f.name)
    return [t async for ev in await member.role.submit(prompt, Sampling(max_tokens=8)) for t in ev.tokens]


async def test_a_later_joiner_fetches_from_the_member_that_kept_replicas_and_every_block_is_on_two_disks(
    rdv, tiny_chat_model, tmp_path
) -> None:
    total = sum(t.nbytes for t in Checkpoint.open(tiny_chat_model).tensors.values())
    prompt = Tokenizer.from_checkpoint(Checkpoint.open(tiny_chat_model)).encode("The capital of France is")
    # a session of two: beta keeps the host's shard as its replica, so its disk holds every block
    first = await form(rdv, tmp_path, tiny_chat_model, ["beta"])
    try:
        await replicas_kept(first)
        want = await answers(first, prompt)
        m = first[1].shard.manifest
        assert m is not None and held(first[1], m) == set(m.tensors)
    finally:
        for f in first:
            await f.close()
    # the next session: gamma, new here, fetches its shard from beta rather than the host
    formed = await form(rdv, tmp_path, tiny_chat_model, ["beta", "gamma"])
    try:
        alpha, beta, gamma = formed
        assert beta.shard.tensor_bytes == 0  # all from its own cache
        got = gamma.shard
        assert got.tensor_bytes > 0 and got.sources.get("peer beta", 0) >= 0.9 * got.bytes_fetched
        assert got.kinds.get("host", 0) <= 0.1 * got.bytes_fetched
        assert await answers(formed, prompt) == want
        await replicas_kept(formed)
        plan = alpha.plan
        names = set(m.tensors)
        disks = {f.name: held(f, m) for f in (beta, gamma)} | {"alpha": names}  # the host: its folder
        for name in names:  # every tensor on two members' disks: the host's and at least one other
            holders = [who for who, have in disks.items() if name in have]
            assert len(holders) >= 2, (name, holders)
        for f in (beta, gamma):  # within the bound: its own shard and the next member's, no more
            a, b = plan.block_range(f.name)
            nxt = plan.stage(plan.successor(f.name))
            mine = Checkpoint.open(tiny_chat_model).names_for(range(a, b), plan.head == f.name)
            theirs = Checkpoint.open(tiny_chat_model).names_for(range(nxt.start, nxt.stop), nxt.head)
            if f is beta:
                continue  # beta's disk also holds what the earlier session gave it
            assert disks[f.name] == set(mine) | set(theirs)
            assert sum(m.tensors[n].nbytes for n in disks[f.name]) < total
    finally:
        for f in formed:
            await f.close()


async def test_a_newcomer_in_a_lost_members_place_is_planned_by_what_the_others_hold_on_disk(
    rdv, tiny_chat_model, tmp_path
) -> None:
    """A session of three, each joiner keeping the next member's share; then the same session
    with gamma replaced by delta, whose cache is empty. The members report what their caches hold
    (beta: its share and gamma's, read from its blob store), the host's plan says how many bytes
    come from it and from members, and the fetches move exactly those bytes: what beta holds comes
    from beta, only what no member but the host holds comes from the host."""
    first = await form(rdv, tmp_path, tiny_chat_model, ["beta", "gamma"])
    try:
        await replicas_kept(first)
        m = first[1].shard.manifest
        assert m is not None
        p1, tensors = first[0].plan, held(first[1], m)
    finally:
        for f in first:
            await f.close()
    beta_held = held_in_cache(tmp_path / "beta", m.checkpoint)
    whole = [b for b in range(m.n_blocks) if set(stage_tensors(m.tensors, range(b, b + 1), False)) <= tensors]
    head = set(stage_tensors(m.tensors, range(0), True)) <= tensors
    assert beta_held == Held(frozenset(whole), head), (beta_held, p1.stages)  # what its blobs say
    own, nxt = p1.stage("beta"), p1.stage(p1.successor("beta"))  # (a re-plan meanwhile may have left more)
    assert beta_held.blocks >= {*range(own.start, own.stop), *range(nxt.start, nxt.stop)}  # share, replica
    assert beta_held.head >= nxt.head
    assert held_in_cache(tmp_path / "delta", m.checkpoint) == Held()
    formed = await form(rdv, tmp_path, tiny_chat_model, ["beta", "delta"])
    try:
        alpha, beta, delta = formed
        shares = {f.name: (f.shard.blocks, f.shard.head) for f in (beta, delta)}  # as formed
        orphan = {e.name: e.nbytes for e in m.tensors.values() if not _held_by(beta_held, e.name)}
        wanted = {n for blocks, head in shares.values() for n in stage_tensors(m.tensors, blocks, head)}
        from_host = {f.name: f.shard.kinds.get("host", 0) for f in (beta, delta)}
        assert sum(from_host.values()) == sum(n for name, n in orphan.items() if name in wanted), from_host
        got = delta.shard
        peer_tensors = got.kinds.get("peer", 0) - got.meta_bytes  # its headers came from beta too
        assert peer_tensors == got.tensor_bytes - from_host["delta"] and beta.shard.kinds.get("peer", 0) == 0
        plan = alpha.plan  # the plan formed, unless a path measured since re-planned the ring
        if all((range(s.start, s.stop), s.head) == shares[s.name] for s in plan.stages if s.name in shares):
            predicted = (plan.host_bytes, plan.peer_bytes)
            assert predicted == (sum(from_host.values()), peer_tensors), plan.summary()
    finally:
        for f in formed:
            await f.close()


def _held_by(h: Held, name: str) -> bool:
    b = block_index(name)
    return h.head if b is None else b in h.blocks


async def test_a_member_serves_what_it_holds_by_range_over_a_link_and_its_own_copy_once_asked(
    tiny_checkpoint, tmp_path
) -> None:
    """Two members on one authenticated QUIC link on loopback: m1 fetched blocks [0, 2) from the host
    and serves them; m2 fetches that shard from m1 alone, is refused what m1 lacks, then m1 loads its
    own copy of the checkpoint and serves all of it."""
    from kafila.net.auth import EdgeContext
    from kafila.session.channel import MemoryChannel
    from kafila.session.weights.fetch import fetch_shard
    from kafila.session.weights.manifest import FetchRefused
    from kafila.session.weights.peers import HeldFiles, PeerReader
    from kafila.session.weights.server import WeightServer
    from kafila.session.weights.sharing import Sharing
    from tests.net.conftest import direct_pair

    folder = tiny_checkpoint("llama-mha-untied", sharded=True)
    server = WeightServer(folder, cache=tmp_path / "host")

    async def from_host(name: str, blocks: range, **kw) -> object:
        member, host_end = MemoryChannel.pair("host", name)[::-1]
        serving = asyncio.ensure_future(server.serve(host_end, timeout=30))
        try:
            return await fetch_shard(
                member, blocks, False, cache=tmp_path / name, local=[], progress=False, **kw
            )
        finally:
            await asyncio.wait_for(serving, 10)

    ctx = EdgeContext("S-peers", "m2", "m1", b"correct horse")
    client, link_m1, a, b = await direct_pair(ctx, ctx)  # m2's end, m1's end
    try:
        await asyncio.gather(client.wait_ready(), link_m1.wait_ready())
        sharing = Sharing(tmp_path / "m1")
        sharing.attach({"m2": link_m1})
        first = await from_host("m1", range(0, 2), on_manifest=sharing.known)
        m = first.manifest
        peer = PeerReader(client, "m1")
        assert await peer.prepare(m) and peer.holding.tensors == set(first.tensors)
        other = m.tensors[Checkpoint.open(folder).names_for(range(2, 3), False)[0]]
        assert not peer.offers(other.file, other.start, other.end)
        with pytest.raises(FetchRefused, match="not held by this member"):
            HeldFiles(tmp_path / "m1", m).read(other.file, other.start, 8)
        before = server.stats["m1"].bytes_sent
        got = await from_host("m2", range(0, 2), sources=[peer])
        assert got.kinds == {"peer": got.bytes_fetched} and got.tensor_bytes == first.tensor_bytes
        assert server.stats.get("m2") is None or server.stats["m2"].bytes_sent == 0
        assert server.stats["m1"].bytes_sent == before
        sharing.local_copy(folder)  # now it holds the whole checkpoint: described when asked
        whole = PeerReader(client, "m1")
        assert await whole.prepare(m) and whole.holding.tensors == set(m.tensors)
        rest = await from_host("m2", range(2, 5), sources=[whole])
        assert set(rest.kinds) == {"peer"} and rest.tensor_bytes > 0
        await sharing.close()
    finally:
        await client.close()
        await link_m1.close()
        a.close()
        b.close()


async def test_a_member_that_does_not_know_the_checkpoint_yet_answers_nothing_held_instead_of_silence(
    tiny_checkpoint, tmp_path
) -> None:
    """m1 has no manifest yet (its own fetch has not begun): m2's question gets "nothing held" after
    m1's short wait, so m2 takes its ranges from the next source instead of waiting 23 s on m1."""
    import time

    from kafila.net.auth import EdgeContext
    from kafila.session.weights.manifest import describe
    from kafila.session.weights.peers import PeerReader, PeerServer
    from tests.net.conftest import direct_pair

    m = describe(Path(tiny_checkpoint("llama-mha-untied")), cache=tmp_path / "hashes")
    ctx = EdgeContext("S-peers", "m2", "m1", b"correct horse")
    client, link_m1, a, b = await direct_pair(ctx, ctx)
    try:
        await asyncio.gather(client.wait_ready(), link_m1.wait_ready())
        PeerServer(wait_s=0.5).attach({"m2": link_m1})
        started = time.monotonic()
        assert not await PeerReader(client, "m1").prepare(m)
        assert time.monotonic() - started < 5  # its answer, not the asker's 23 s of retries
    finally:
        await client.close()
        await link_m1.close()
        a.close()
        b.close()
