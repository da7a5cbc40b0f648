"""kafila.session.start: what a joining member takes from the host, what a member offers, and
what /session shows of its links."""

from __future__ import annotations

import asyncio

import pytest

from kafila.session.errors import SessionError
from kafila.session.forming.join import in_session_formats
from kafila.session.terms import Options


def test_a_member_probes_in_the_hosts_dtype_whatever_it_was_given() -> None:
    mine = Options(dtype="fp32", name="beta")
    took = in_session_formats(mine, {"role": "host", "dtype": "bf16"})
    assert (took.dtype, took.name, mine.dtype) == ("bf16", "beta", "fp32")  # a copy; the rest kept
    assert in_session_formats(mine, {"role": "host"}).dtype == "auto"  # a host that names none
    with pytest.raises(SessionError, match="dtype 'int4'"):
        in_session_formats(mine, {"dtype": "int4"})


def test_a_member_probes_in_the_hosts_weight_format() -> None:
    mine = Options(quant="int8", name="beta")
    assert in_session_formats(mine, {"role": "host", "dtype": "fp32", "quant": "q4"}).quant == "q4"
    assert in_session_formats(mine, {"role": "host", "dtype": "fp32"}).quant == "auto"  # names none
    with pytest.raises(SessionError, match="weight format 'q3'"):
        in_session_formats(mine, {"quant": "q3"})


def test_the_host_resolves_the_sessions_weight_format_from_the_folder(tiny_checkpoint, tmp_path) -> None:
    """auto is the folder's own; a packed folder is served as packed or widened, never repacked in
    another format (its matrices would stay as stored while the session said otherwise)."""
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.quantize import quantize_folder
    from kafila.session.forming.host import session_quant

    floats = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))
    packed = Checkpoint.open(quantize_folder(floats.path, "q4", tmp_path / "q4", progress=False))
    assert [session_quant(q, floats) for q in ("auto", "none", "int8", "q4")] == [
        "none",
        "none",
        "int8",
        "q4",
    ]
    assert [session_quant(q, packed) for q in ("auto", "none", "q4")] == ["q4", "none", "q4"]
    with pytest.raises(SessionError, match=r"packed in q4: serve them as q4 .* not repacked in int8"):
        session_quant("int8", packed)


def test_memory_gb_caps_what_a_member_offers_and_never_raises_it(capsys) -> None:
    """--memory-gb 100 on a machine with 23 GB offered 100 GB, and the planner trusted it."""
    from kafila.planner.devices import DeviceReport
    from kafila.session.forming.measure import capped

    measured = DeviceReport("laptop", 23 * 10**9, 5e9)
    assert capped(measured, None) == measured
    assert capped(measured, 8 * 10**9).memory_bytes == 8 * 10**9
    assert capped(measured, 100 * 10**9).memory_bytes == 23 * 10**9
    said = capsys.readouterr().err
    assert (
        "laptop: --memory-gb 100 is more than this device has for weights (23.0 GB): offering 23.0 GB" in said
    )


async def test_session_shows_a_closed_link_as_closed_not_its_last_path() -> None:
    from kafila.net.auth import EdgeContext
    from kafila.session.ring.build import follow_paths
    from tests.net.conftest import direct_pair

    ctx = EdgeContext("S", "alice", "bob", b"secret")
    client, server, a, b = await direct_pair(ctx, ctx)
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        shown: dict[str, str] = {}
        follow_paths(shown, {"alice->bob": client})
        assert shown == {"alice->bob": "direct"}
        await client.close("gone")
        assert shown == {"alice->bob": "closed"}
    finally:
        await server.close()
        a.close()
        b.close()


def test_two_members_on_one_machine_cannot_both_reserve_the_api_port() -> None:
    """A host and a member on one machine, both with the default --api: both bound 11434 (SO_REUSEADDR,
    neither listening yet), and the host's server failed with a traceback once the session had formed."""
    from kafila.session.runtime import reserve_api

    first = reserve_api(Options(api="127.0.0.1:0"))
    assert first is not None
    try:
        port = first.getsockname()[1]
        taken = f"cannot serve the API on 127.0.0.1:{port}: Address already in use"
        with pytest.raises(SessionError, match=taken):
            reserve_api(Options(api=f"127.0.0.1:{port}"))
    finally:
        first.close()


def test_the_join_line_names_the_rendezvous_unless_it_is_the_default() -> None:
    from kafila.proto.codes import parse_code
    from kafila.session.forming.signaling import join_command
    from kafila.session.terms import DEFAULT_RENDEZVOUS

    code = parse_code("4-k7m2-tiger-lamp-ocean")
    assert join_command(code, DEFAULT_RENDEZVOUS) == "kafila join 4-k7m2-tiger-lamp-ocean"
    assert join_command(code, "wss://rv.lab.example:8470/v1/signal") == (
        "kafila join 4-k7m2-tiger-lamp-ocean --rendezvous wss://rv.lab.example:8470/v1/signal"
    )


async def test_a_member_the_ring_counted_gone_is_told_that_the_silent_member_was_itself() -> None:
    """A member stopped for 9 s (SIGSTOP) woke to the head's "broken" and said "the ring is broken:
    member m1 stopped answering" as m1, as if about another member."""
    from kafila.proto.ring import Cause
    from kafila.session.channel import ChannelDead, Heartbeat, MemoryChannel
    from kafila.session.ring.build import broken_line

    _, hb = MemoryChannel.pair("m1", "hosty")  # hosty listens for m1's beats; m1 sends none
    with pytest.raises(ChannelDead) as silent:
        await Heartbeat(hb, dead_after=0.2, interval=10.0, first_within=0.2).recv()
    broken = silent.value.broken()  # what the head's "broken" carries round the ring
    assert (broken.member, broken.cause) == ("m1", Cause.SILENT)
    why = broken.text()
    assert why == "the ring is broken: member m1 stopped answering (nothing heard for 0.2 s, the bound)"
    mine = broken_line("m1", broken)
    assert mine.startswith(f"{why}: that is this member, whose process did not run in time")
    assert mine.endswith(
        "This member answers requests with 503 from now on: end it (Ctrl-C) and form a new session"
    )
    for other in ("hosty", "m1-5", "m"):
        assert broken_line(other, broken) == f"{why}. {mine.split('. ', 1)[1]}"


LOCAL_OR_OPEN = [("127.0.0.1:0", False), ("localhost:0", False), ("[::1]:0", False), ("0.0.0.0:0", True)]


@pytest.mark.parametrize(("api", "open_"), LOCAL_OR_OPEN)
def test_an_api_open_to_other_machines_needs_a_key_or_insecure_no_key(api: str, open_: bool) -> None:
    from kafila.api.security import ApiSecurity
    from kafila.session.runtime import reserve_api

    if open_:
        with pytest.raises(SessionError, match="would be open to other machines with no key"):
            reserve_api(Options(api=api))
    for security in ([ApiSecurity()] if not open_ else []) + [
        ApiSecurity(keys=("k" * 16,)),
        ApiSecurity(insecure=True),
    ]:
        sock = reserve_api(Options(api=api, api_security=security))
        assert sock is not None
        sock.close()
