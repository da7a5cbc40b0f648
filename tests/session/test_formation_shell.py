"""The asyncio shell around the formation cores (kafila.session.forming's host/join with its Driver) on a real
rendezvous: deadlines and departures end an attempt promptly, with the core's message, and the
members who came are told. Where the other side is a bare signaling client that does not run the
host's code, the test name says the host is simulated."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from pathlib import Path

import pytest

from kafila.net.signaling import SignalingClient
from kafila.planner.devices import DeviceReport
from kafila.planner.plan import Plan, Stage
from kafila.proto import signaling as sig
from kafila.proto.codes import new_code, parse_code
from kafila.proto.session import SESSION_VERSION, SessionTerms
from kafila.rendezvous.server import RendezvousServer
from kafila.session.errors import SessionError
from kafila.session.forming.core import KEY, payload
from kafila.session.forming.host import host
from kafila.session.forming.join import join
from kafila.session.terms import Options
from tests.session.conftest import make_tiny_chat
from tests.session.hosting import code_of

pytestmark = [pytest.mark.network, pytest.mark.slow]
SHUT_DOWN = r"^the session could not form: the rendezvous shut down or is restarting \(WebSocket close 1012"


TINY = "llama-gqa3-tied"  # a tiny checkpoint for the host (tests/conftest.py)


def opts(rdv: RendezvousServer, name: str, tmp: Path, **kw) -> Options:
    base = dict(
        rendezvous=rdv.url, name=name, api=None, cache=tmp / name, probe_repeats=1, wait_s=60, context=64
    )
    return Options(**(base | kw))


async def simulated_host(rdv: RendezvousServer) -> tuple[SignalingClient, str]:
    """A bare signaling client in the host's place: it opens the session and never plans."""
    client = await SignalingClient.connect(rdv.url)
    opened = await client.open_session("tiny", 2, "simulated-host", {"role": "host"})
    code = new_code(opened.session)
    await client.protect(code)
    return client, str(code)


async def next_report(client: SignalingClient) -> int:
    while True:
        event = await client.next_event(timeout=60)
        if isinstance(event, sig.SignalFrom) and event.payload.get(KEY) == SESSION_VERSION:
            assert event.payload["op"] == "report"
            return event.sender


async def test_member_gives_up_by_its_deadline_when_a_simulated_host_never_plans(rdv, tmp_path) -> None:
    client, code = await simulated_host(rdv)
    try:
        joining = asyncio.ensure_future(join(code, opts(rdv, "beta", tmp_path, wait_s=2)))
        await next_report(client)
        started = time.monotonic()
        with pytest.raises(SessionError, match=r"^no plan from the host within 2 s$"):
            await joining
        assert time.monotonic() - started < 10
    finally:
        await client.close()


HOST_GONE = r"^the host (left|lost its connection to the rendezvous) before the session formed$"


async def test_member_stops_at_once_when_a_simulated_host_leaves(rdv, tmp_path) -> None:
    client, code = await simulated_host(rdv)
    joining = asyncio.ensure_future(join(code, opts(rdv, "beta", tmp_path, wait_s=60)))
    await next_report(client)
    started = time.monotonic()
    await client.close("going away")
    with pytest.raises(SessionError, match=HOST_GONE):
        await joining
    assert time.monotonic() - started < 10  # not the 60 s wait


def two_member_plan() -> Plan:
    stages = (Stage("simulated-host", 0, 1, True, None, 0, 0), Stage("beta", 1, 2, False, None, 0, 0))
    return Plan(
        division="uniform",
        feasible=True,
        reason=None,
        tier="full",
        ordering="exact",
        notes=(),
        order=("simulated-host", "beta"),
        head="simulated-host",
        stages=stages,
        edges=(),
        n_blocks=2,
        context=64,
        concurrency=1,
    )


async def test_member_linking_is_cut_short_when_a_simulated_host_leaves(rdv, tmp_path) -> None:
    """The plan arrives, the member starts linking to a host that never answers on the link, and the
    host leaving ends the attempt at once instead of after the link's own timeouts."""
    client, code = await simulated_host(rdv)
    joining = asyncio.ensure_future(join(code, opts(rdv, "beta", tmp_path, wait_s=60)))
    member = await next_report(client)
    ids = {"simulated-host": client.member, "beta": member}
    terms = SessionTerms("tiny", 4, 8, "fp32", 64, 1, "kafila").to_dict()
    origins = {"simulated-host": 1, "beta": 2}
    body = payload(
        "plan",
        plan=two_member_plan().to_dict(),
        ids=ids,
        terms=terms,
        origins=origins,
        succession=["beta"],
        probes={},
    )
    await client.signal(member, body)
    await asyncio.sleep(1.0)  # the member is linking now
    assert not joining.done()
    started = time.monotonic()
    await client.close("going away")
    with pytest.raises(SessionError, match=HOST_GONE):
        await joining
    assert time.monotonic() - started < 5


async def test_host_timeout_names_who_came_and_tells_them(rdv, tmp_path, tiny_checkpoint) -> None:
    """beta joins at once; whether its report beats the host's 4 s gathering deadline depends on how
    fast it measures itself, so either count is right as long as the names match it, and beta is
    told in both cases (a joined member still measuring itself is told too, and named as such once
    its link checked its code)."""
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    hosting = asyncio.ensure_future(
        host(
            opts(rdv, "alpha", tmp_path, model=str(tiny_checkpoint(TINY)), members=3, wait_s=4),
            on_code=code.set_result,
        )
    )
    c = await code_of(code, hosting)
    joining = asyncio.ensure_future(join(c, opts(rdv, "beta", tmp_path, wait_s=60)))
    arrived = (
        r"only (1 of 3 members arrived within 4 s \(joined: alpha(; still measuring itself: beta)?\)"
        r"|2 of 3 members arrived within 4 s \(joined: alpha, beta\))"
    )
    with pytest.raises(SessionError, match=f"^{arrived}; ask the others"):
        await hosting
    started = time.monotonic()
    with pytest.raises(SessionError, match=f"^the host refused the session: {arrived}"):
        await joining
    assert time.monotonic() - started < 10  # told, not left to its own 60 s deadline


async def test_a_simulated_member_that_never_links_is_removed_and_its_place_taken(
    rdv, tmp_path, tiny_chat_model, monkeypatch
) -> None:
    """gamma is a bare signaling client standing in for a member: it reports and never links with
    the host. The host does not plan with it (it used to, and the session then failed for everyone
    when gamma left): once their link times out gamma is refused and removed at the rendezvous, and
    delta, a real member, takes the place with the same code."""
    from kafila.session.forming import driver

    said: list[str] = []
    monkeypatch.setattr(driver, "say", lambda text: said.append(text))
    c, (hosting, beta) = await host_and(rdv, tmp_path, str(tiny_chat_model), 3, ["beta"])
    gamma = await SignalingClient.connect(rdv.url)
    joined = await gamma.join(parse_code(c), "gamma", {"role": "member"})
    host_id = next(m.id for m in joined.members if m.host)
    report = DeviceReport(name="gamma", memory_bytes=8_000_000_000, bandwidth_bytes_s=20e9, overhead_s=1e-4)
    await gamma.signal(host_id, payload("report", device=report.to_dict()))
    ops = []
    while True:  # the host's refusal, then the rendezvous ends gamma's membership
        event = await gamma.next_event(timeout=60)
        if isinstance(event, sig.SignalFrom) and event.payload.get(KEY) == SESSION_VERSION:
            ops.append(event.payload["op"])
        if isinstance(event, sig.Error):
            assert event.fatal and event.code == "removed" and "gamma was not admitted" in event.message
            break
    assert ops == ["refused"]  # never a plan
    assert any(s.startswith("gamma was not admitted: link alpha <-> gamma: ") for s in said), said
    assert not hosting.done() and not beta.done()
    delta = asyncio.ensure_future(join(c, opts(rdv, "delta", tmp_path)))
    formed = await asyncio.gather(hosting, beta, delta)
    try:
        assert set(formed[0].plan.order) == {"alpha", "beta", "delta"}
    finally:
        for f in formed:
            await f.close()
        await gamma.close()


async def test_host_stops_at_once_when_the_rendezvous_goes_away_while_it_waits(
    rdv, tmp_path, tiny_checkpoint
) -> None:
    """No member can join without the rendezvous: the host says so instead of waiting out its 60 s."""
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    hosting = asyncio.ensure_future(
        host(
            opts(rdv, "alpha", tmp_path, model=str(tiny_checkpoint(TINY)), members=2, wait_s=60),
            on_code=code.set_result,
        )
    )
    await code_of(code, hosting)
    await asyncio.sleep(1.0)  # the host is measuring itself or waiting for its member
    started = time.monotonic()
    await rdv.stop()  # closes every signaling connection (1012, service restart)
    with pytest.raises(SessionError, match=SHUT_DOWN):
        await hosting
    assert time.monotonic() - started < 30  # the probe in progress ends first, then the host stops


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer: sessions that start their rings."""
    return make_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), smollm2_tokenizer, blocks=6)


async def host_and(rdv, tmp_path, model: str, members: int, joiners: list[str]) -> tuple[str, list]:
    """A real host and real joiners, started at once; returns the code and every attempt's task."""
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    hosting = asyncio.ensure_future(
        host(opts(rdv, "alpha", tmp_path, model=model, members=members), on_code=code.set_result)
    )
    c = await code_of(code, hosting)
    return c, [hosting, *(asyncio.ensure_future(join(c, opts(rdv, n, tmp_path))) for n in joiners)]


async def test_a_ready_member_ends_when_another_fails_to_start(rdv, tmp_path, tiny_chat_model, monkeypatch):
    """beta is ready while gamma is still fetching (its fetch simulated slow: it waits until the
    test ends it); gamma leaving then ends every side. beta used to count itself formed at its own
    ready and serve a ring that never formed, until someone killed it."""
    from kafila.session.forming import driver, join

    said: list[str] = []
    monkeypatch.setattr(driver, "say", lambda text: said.append(text))
    real_fetch = join._fetch

    async def fetch(got, links, o, sharing):
        if got.me == "gamma":
            await asyncio.Event().wait()  # the simulated slow fetch: until cancelled
        return await real_fetch(got, links, o, sharing)

    monkeypatch.setattr(join, "_fetch", fetch)
    _, (hosting, beta, gamma) = await host_and(rdv, tmp_path, str(tiny_chat_model), 3, ["beta", "gamma"])
    for _ in range(600):  # beta is ready once the host has said so
        if "beta ready (1/2)" in said:
            break
        await asyncio.sleep(0.1)
    assert "beta ready (1/2)" in said and "ready; waiting for the other members" in said
    assert not beta.done()  # ready is not formed
    started = time.monotonic()
    gamma.cancel()  # gamma gives up (Ctrl-C while fetching): it leaves the session
    gone = r"gamma (left|lost its connection to the rendezvous) before the session formed"
    with pytest.raises(SessionError, match=f"member {gone}"):
        await hosting
    with pytest.raises(SessionError, match=gone):
        await beta
    assert time.monotonic() - started < 10


async def test_a_member_that_cannot_store_its_weights_is_named_with_why_at_the_host(
    rdv, tmp_path, tiny_chat_model, capsys
):
    """The host said only "member beta left before the session formed"; why was in a log line."""
    (tmp_path / "beta").mkdir()
    (tmp_path / "beta" / "weights").write_text("a file where the cache keeps a folder")
    _, (hosting, beta) = await host_and(rdv, tmp_path, str(tiny_chat_model), 2, ["beta"])
    from kafila.session.weights.manifest import WeightsError

    with pytest.raises(WeightsError, match=f"cannot use the weight cache under {tmp_path / 'beta'}: "):
        await beta
    gone = r"member beta (left|lost its connection to the rendezvous) before"
    with pytest.raises(SessionError, match=gone):
        await hosting
    said = capsys.readouterr().err
    assert (
        f"kafila: beta could not take its weights: cannot use the weight cache under {tmp_path / 'beta'}"
        in said
    )


def slow_probe(monkeypatch, measuring: threading.Event | None = None) -> threading.Event:
    """From now on a member's probe is simulated slow: it waits until the returned event is set
    (at most 60 s), then ends without measuring (nobody waits for it by then)."""
    from kafila.session.forming import host, join

    release = threading.Event()

    def probe(*args, **kw):  # type: ignore[no-untyped-def]
        if measuring is not None:
            measuring.set()
        release.wait(60)
        raise RuntimeError("the simulated probe ends without measuring")

    monkeypatch.setattr(host, "probe_report", probe)
    monkeypatch.setattr(join, "probe_report", probe)
    return release


async def test_joining_a_formed_session_is_admitted_while_serving_and_one_without_host_is_named(
    rdv, tmp_path, tiny_chat_model, monkeypatch, capsys
):
    """A member joins a formed, serving session: the host links with it at once and its link's
    authentication admits it (kafila.session.forming.arrivals), while the newcomer still measures
    itself (its probe is simulated slow here, so it never reports); the host then waits for its
    report, to let the planner decide. With the host stopped on purpose and a member left, joining
    names that (it was a StopIteration traceback), and the member left does not take the host's place."""
    model = str(tiny_chat_model)
    code, (hosting, beta) = await host_and(rdv, tmp_path, model, 2, ["beta"])
    formed = [await hosting, await beta]
    release = slow_probe(monkeypatch)  # the newcomer's probe waits until the test ends it
    joining = asyncio.ensure_future(join(code, opts(rdv, "late", tmp_path, wait_s=60)))
    try:
        said = ""
        deadline = time.monotonic() + 10  # not after its own probe
        while "late holds the session code; waiting for its report" not in said:
            assert time.monotonic() < deadline and not joining.done(), said[-2000:]
            await asyncio.sleep(0.1)
            said += capsys.readouterr().err
        assert "late joined the serving session; linking with it to check its session code" in said
        assert "linked with the host alpha" in said  # the newcomer's side of the same link
    finally:
        release.set()
        joining.cancel()
        with contextlib.suppress(BaseException):
            await joining
        monkeypatch.undo()  # real probes again for the next session
        for f in formed:
            await f.close()
    code, (hosting, beta) = await host_and(rdv, tmp_path, model, 2, ["beta"])
    formed = [await hosting, await beta]
    try:
        await formed[0].close()  # the host ends the session on purpose; beta stays in it
        await _until(lambda: formed[1].host_ended, "beta hears that the host ended the session")
        with pytest.raises(
            SessionError, match=r"^session \S+ has no host any more; ask for a new session code$"
        ):
            await join(code, opts(rdv, "late", tmp_path))
        assert "takes over" not in capsys.readouterr().err  # no successor for a host stopped on purpose
    finally:
        await formed[1].close()


async def _generate(role, prompt: list[int]) -> str | None:
    from kafila.api.service import Sampling

    gen = await role.submit(prompt, Sampling(max_tokens=3))
    return [ev async for ev in gen][-1].finish


async def _until(check, what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("path", ["direct", "relay (simulated: links forced onto the relay)"])
async def test_a_formed_ring_serves_on_while_the_rendezvous_restarts_and_registers_its_session_again(
    path, tmp_path, tiny_chat_model, monkeypatch
):
    """The rendezvous going away after forming: each member says so once, /session says
    "reconnecting" with the attempt and reason, the ring answers meanwhile; the rendezvous comes
    back on the same port with the same kept secret, the host re-opens the session under the same
    code and the member takes its place back, and a new member's join with the code reaches the
    host again (which refuses it: the session has formed). With the ring's link on the relay (no
    direct candidates offered: loopback would punch), the restarted relay takes the channel back
    and the link serves across the restart."""
    from dataclasses import replace

    from kafila.net import edge
    from kafila.net.backoff import Backoff
    from kafila.net.edge import EdgeOptions
    from kafila.rendezvous.server import ServerConfig
    from kafila.session.forming import links as forming_links
    from kafila.session.forming import reconnect
    from tests.net.harness import LAB_LIMITS

    said: list[str] = []
    monkeypatch.setattr(reconnect, "say", lambda text: said.append(text))
    monkeypatch.setattr(reconnect, "SCHEDULE", Backoff(0.05, 0.4))
    relayed = path != "direct"
    if relayed:  # every edge, the control link too, offers no candidates: only the relay is left

        @dataclasses.dataclass(frozen=True)
        class RelayOnly(EdgeOptions):
            use_direct: bool = False

        monkeypatch.setattr(edge, "EdgeOptions", RelayOnly)
        monkeypatch.setattr(forming_links, "EdgeOptions", RelayOnly)
    config = ServerConfig(
        host="127.0.0.1", port=0, udp_port=0, udp_alt_port=0, limits=LAB_LIMITS, relay_secret=bytes(range(32))
    )
    rdv = RendezvousServer(config)
    await rdv.start()
    code, (hosting, beta) = await host_and(rdv, tmp_path, str(tiny_chat_model), 2, ["beta"])
    formed = [await hosting, await beta]
    again = RendezvousServer(
        replace(config, port=rdv.http_port, udp_port=rdv.udp.port, udp_alt_port=rdv.udp.alt_port)
    )
    try:
        for f in formed:
            assert f.role.describe()["rendezvous"] == {"url": rdv.url, "state": "connected"}
            assert {link.path for link in f.links.values()} == {"relay" if relayed else "direct"}
        await rdv.stop()
        lost = "lost the rendezvous: the rendezvous shut down or is restarting (WebSocket close 1012)"
        await _until(lambda: sum(s.startswith(lost) for s in said) == 2, "both say they lost it")
        for f in formed:
            await _until(lambda f=f: f.role.describe()["rendezvous"].get("attempt", 0) >= 1, "retries")
            seen = f.role.describe()["rendezvous"]
            assert (seen["url"], seen["state"]) == (rdv.url, "reconnecting"), seen
            assert seen["reason"] == "connection refused: nothing listens on that port", seen
        assert sum(s.startswith(lost) for s in said) == 2, said  # one line per change, not per attempt
        # a request while it is down: served on a direct link at once; on the relay it waits for the
        # relay's return (a quick restart: a relayed ring edge is silent meanwhile, and the ring
        # gives a neighbour 5 s of silence)
        answered = asyncio.ensure_future(_generate(formed[1].role, [1, 2, 3]))
        if not relayed:
            assert await asyncio.wait_for(answered, 20) == "length"
        await asyncio.sleep(0.3)
        await again.start()
        assert await asyncio.wait_for(answered, 20) == "length"
        for f in formed:
            await _until(lambda f=f: f.role.describe()["rendezvous"]["state"] == "connected", "back")
            seen = f.role.describe()["rendezvous"]
            assert seen["reconnects"] == 1 and seen["last_lost"] in lost, seen
        assert sum(s.startswith("back at the rendezvous after") for s in said) == 2, said
        assert again.registry is not None and again.registry.member_count == 2
        assert await _generate(formed[1].role, [4, 5, 6]) == "length"  # across the restarted relay too
        for f in formed:
            assert {link.path for link in f.links.values()} == {"relay" if relayed else "direct"}
        # the members named their relay legs when they came back (a direct link keeps one as its
        # fallback): the restarted relay has the channel back, and knows it is the session's
        assert again.relay.totals.recovered == 1
        assert {c.session for c in again.relay.channels.values()} == set(again.registry.sessions)
        # a new member joins afterwards: the restarted rendezvous admits it into the formed session
        late = asyncio.ensure_future(join(code, opts(again, "late", tmp_path)))
        try:
            await _until(lambda: again.registry is not None and again.registry.member_count == 3, "late in")
            assert not late.done() or late.exception() is None
        finally:
            late.cancel()
            with contextlib.suppress(BaseException):
                await late
    finally:
        for f in formed:
            await f.close()
        await again.stop()


async def test_a_member_with_a_wrong_secret_word_is_not_admitted_and_a_right_one_takes_its_place(
    rdv, tmp_path, tiny_chat_model, monkeypatch
):
    """carol's code has another valid last word: the rendezvous refuses her join (its proof of the
    secret words does not match), so she never takes a place nor reaches the host, and dave joins
    with the right code. A mistyped word used to end the attempt for every member (the host planned
    with carol, then the ring's links failed)."""
    from kafila.proto.codes import WORDS
    from kafila.session.forming import driver

    said: list[str] = []
    monkeypatch.setattr(driver, "say", lambda text: said.append(text))
    code, (hosting, beta) = await host_and(rdv, tmp_path, str(tiny_chat_model), 3, ["beta"])
    *head, last = code.split("-")
    public = "-".join(head[:2])
    wrong = "-".join([*head, next(w for w in WORDS if w != last)])
    with pytest.raises(SessionError) as carol:
        await join(wrong, opts(rdv, "carol", tmp_path))
    assert str(carol.value).startswith(
        f"the rendezvous at {rdv.url} would not join session {public}: that is not session {public}'s "
        "code: its secret words differ (a mistyped word?)"
    ), carol.value
    assert not any("carol" in s for s in said), said  # the host never heard of her
    assert not hosting.done() and not beta.done()
    formed = await asyncio.gather(hosting, beta, join(code, opts(rdv, "dave", tmp_path)))
    try:
        assert set(formed[0].plan.order) == {"alpha", "beta", "dave"}
    finally:
        for f in formed:
            await f.close()


async def test_a_wrong_secret_word_is_found_while_host_and_member_still_measure_themselves(
    rdv, tmp_path, tiny_checkpoint, monkeypatch
) -> None:
    """carol's mistyped word ends her attempt at the rendezvous within seconds, while the host's
    probe still runs (simulated slow here: it waits until the test ends it). It used to come out
    only once both had measured themselves (10-20 s each here)."""
    from kafila.proto.codes import WORDS
    from kafila.session.forming import driver

    said: list[str] = []
    monkeypatch.setattr(driver, "say", lambda text: said.append(text))
    measuring = threading.Event()
    release = slow_probe(monkeypatch, measuring)
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    model = str(tiny_checkpoint(TINY))
    hosting = asyncio.ensure_future(
        host(opts(rdv, "alpha", tmp_path, model=model, members=2), on_code=code.set_result)
    )
    try:
        *head, last = (await code_of(code, hosting)).split("-")
        wrong = "-".join([*head, next(w for w in WORDS if w != last)])
        started = time.monotonic()
        with pytest.raises(SessionError) as carol:
            await asyncio.wait_for(join(wrong, opts(rdv, "carol", tmp_path)), 30)
        assert time.monotonic() - started < 15
        assert "its secret words differ (a mistyped word?)" in str(carol.value), carol.value
        assert "(wrong_secret)" in str(carol.value) and not hosting.done()
    finally:
        release.set()
        with pytest.raises(RuntimeError, match="the simulated probe ends without measuring"):
            await asyncio.wait_for(hosting, 30)


async def test_losing_the_rendezvous_while_measuring_ends_at_once_not_after_the_probe(
    rdv, tmp_path, monkeypatch, tiny_checkpoint
) -> None:
    """The probe (10-20 s on this machine) ran before anything watched the signaling connection:
    a rendezvous gone meanwhile was named only once it ended. A simulated slow probe (it waits
    until the test ends it) keeps the host measuring here."""
    measuring = threading.Event()
    release = slow_probe(monkeypatch, measuring)
    model = str(tiny_checkpoint(TINY))  # not the default model: its package may be absent (a GPU machine)
    hosting = asyncio.ensure_future(host(opts(rdv, "alpha", tmp_path, model=model, members=2)))
    try:
        assert await asyncio.to_thread(measuring.wait, 60)
        await rdv.stop()
        started = time.monotonic()
        with pytest.raises(SessionError, match=SHUT_DOWN):
            await asyncio.wait_for(hosting, 30)
        assert time.monotonic() - started < 10  # not the probe's end
    finally:
        release.set()


async def test_a_members_metrics_listener_serves_while_forming_and_serving_and_stops_on_close(
    rdv, tmp_path, tiny_chat_model, monkeypatch
):
    """`--metrics` (Options.metrics): beta's own /metrics port answers from before the ring forms
    (state forming, while its fetch is held: simulated slow) to its close, and the formed session's
    series and /session document carry what the obs wiring adds (build, plan epoch, NAT, edges, slots)."""
    import httpx

    from kafila.session import runtime
    from kafila.session.forming import join as joining

    said: list[str] = []
    monkeypatch.setattr(runtime, "say", lambda text: said.append(text))
    fetching, go_on = asyncio.Event(), asyncio.Event()
    real_fetch = joining._fetch

    async def fetch(got, links, o, sharing):
        fetching.set()
        await go_on.wait()  # the simulated slow fetch: until the test scraped the forming member
        return await real_fetch(got, links, o, sharing)

    monkeypatch.setattr(joining, "_fetch", fetch)
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    hosting = asyncio.ensure_future(
        host(opts(rdv, "alpha", tmp_path, model=str(tiny_chat_model), members=2), on_code=code.set_result)
    )
    c = await code_of(code, hosting)
    beta = asyncio.ensure_future(join(c, opts(rdv, "beta", tmp_path, metrics="127.0.0.1:0")))
    formed = []
    try:
        await asyncio.wait_for(fetching.wait(), 60)
        url = next(s.removeprefix("metrics at ") for s in said if s.startswith("metrics at "))
        async with httpx.AsyncClient() as http:
            text = (await http.get(url)).text
            assert 'state="forming"} 1.0' in text and 'state="serving"} 0.0' in text
            go_on.set()
            formed = [await hosting, await beta]
            text = (await http.get(url)).text
            assert 'state="serving"} 1.0' in text and "kafila_plan_epoch{" in text
            assert 'kafila_build_info{backend="torch"' in text
        alpha, beta_doc = (f.role.describe() for f in formed)
        head = alpha if alpha["head"] == "alpha" else beta_doc  # the plan chooses the head
        assert head["slots"] == 1  # the schedule's concurrency: the KV-cache gauges' total
        for link in alpha["links"]:  # the host's links are all its own: measured by it
            assert link["measured_by"] == "alpha" and link["path"] in ("direct", "relay"), link
            assert link["planned_path"] in ("direct", "relay"), link
        nat = {m["name"]: m["nat_class"] is not None for m in alpha["members"]}
        assert nat == {"alpha": True, "beta": True}  # the host has every member's report
        nat = {m["name"]: m["nat_class"] is not None for m in beta_doc["members"]}
        assert nat == {"alpha": False, "beta": True}  # another member knows its own NAT only
        await formed.pop().close()
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as http:
                await http.get(url)
    finally:
        go_on.set()
        for f in formed:
            await f.close()
        for task in (hosting, beta):
            task.cancel()
