"""The rendezvous says a member left: the runtime breaks the ring naming it once the member's link
is silent, and not when the link still hears it (only its rendezvous connection went).

An in-process ring (real stages) stands for the member's role and a real QUIC link on loopback
for its link to the member the notice is about; the notice is handed to the runtime as
`Driver.serve_formed` hands it (`on_left`)."""

from __future__ import annotations

import asyncio
import time

import pytest
from structlog.testing import capture_logs

from kafila.models.checkpoint import Checkpoint
from kafila.net.auth import EdgeContext
from kafila.proto.ring import Cause
from kafila.session.forming.links import SESSION_LINKS
from kafila.session.runtime import LEFT_CONFIRM_S, MemberRuntime
from tests.net.conftest import direct_pair
from tests.session.ringkit import build_ring


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))


async def runtime_with_link(ckpt: Checkpoint):  # type: ignore[no-untyped-def]
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)])
    ctx = EdgeContext("S-left", "m0", "m1", b"secret")
    link, peer, ea, eb = await direct_pair(ctx, ctx, SESSION_LINKS)  # a session's links: PING every 0.25 s
    await asyncio.gather(link.wait_ready(), peer.wait_ready())
    runtime = MemberRuntime("host")
    runtime.name, runtime.role, runtime.links = "m0", ring.head, {"m1": link}
    return runtime, ring, (link, peer, ea, eb)


async def close_all(ring, parts) -> None:  # type: ignore[no-untyped-def]
    link, peer, ea, eb = parts
    await link.close()
    await peer.close()
    ea.close()
    eb.close()
    await ring.stop()


async def test_a_member_whose_link_still_answers_is_not_counted_lost(ckpt: Checkpoint) -> None:
    runtime, ring, parts = await runtime_with_link(ckpt)
    try:
        await runtime._confirm_left("m1", "disconnected")
        assert ring.head.broken is None
    finally:
        await close_all(ring, parts)


async def test_a_member_whose_link_is_silent_too_is_lost_with_the_rendezvous_cause(ckpt: Checkpoint) -> None:
    runtime, ring, parts = await runtime_with_link(ckpt)
    try:
        parts[3].close()  # m1's machine is gone without a word: its end of the link sends nothing
        started = time.monotonic()
        await runtime._confirm_left("m1", "disconnected")
        took = time.monotonic() - started
        assert ring.head.broken is not None
        assert (ring.head.broken.member, ring.head.broken.cause.value) == ("m1", "disconnected")
        assert "member m1 lost its connection (disconnected), the rendezvous says" in ring.head.broken.detail
        assert LEFT_CONFIRM_S <= took < LEFT_CONFIRM_S + 1.0
        await runtime._confirm_left("m2", "left")  # already broken: the first reason stays
        assert ring.head.broken.member == "m1"
        heard: list[tuple[str, str, str]] = []
        runtime.on_lost = lambda *lost: heard.append(lost)  # the host re-plans: a loss during it
        await runtime._confirm_left("m1", "disconnected")
        assert [(m, c) for m, c, _ in heard] == [("m1", "disconnected")]
        assert "the rendezvous says" in heard[0][2]
    finally:
        await close_all(ring, parts)


async def test_a_member_without_a_link_to_it_leaves_the_break_to_those_with_one(ckpt: Checkpoint) -> None:
    runtime, ring, parts = await runtime_with_link(ckpt)
    try:
        await runtime._confirm_left("m2", "left")  # m0 has no link to m2 here
        await runtime._confirm_left("stranger", "left")  # not in the ring
        assert ring.head.broken is None
        heard: list[tuple[str, str, str]] = []
        runtime.on_lost = lambda *lost: heard.append(lost)  # a re-plan or a hand-off runs
        ring.head.lose("m1", Cause.SILENT, "m1 stopped answering")  # the ring broke already
        await runtime._confirm_left("m2", "disconnected")  # with no link to confirm by: said at once
        assert heard == [("m2", "disconnected", "member m2 disconnected, the rendezvous says")]
    finally:
        await close_all(ring, parts)


async def test_spawned_work_is_held_by_the_runtime_cancelled_on_close_and_its_failure_logged() -> None:
    runtime = MemberRuntime("member")
    runtime.name = "m1"

    async def fails() -> None:
        raise RuntimeError("the host's link closed")

    with capture_logs() as logs:
        failed = runtime.spawn(fails(), "tell_lost")
        await asyncio.wait([failed])
        await asyncio.sleep(0)
    assert failed not in runtime.tasks
    said = [e for e in logs if e["event"] == "task_failed"]
    assert said and said[0]["task"] == "tell_lost" and "the host's link closed" in said[0]["error"], logs
    pending = runtime.spawn(asyncio.sleep(60), "replan")
    assert pending in runtime.tasks
    await runtime.close()
    await asyncio.wait([pending])
    await asyncio.sleep(0)  # its done callback
    assert pending.cancelled() and pending not in runtime.tasks
