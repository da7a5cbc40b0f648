"""join: take a place in a host's session, from the session code to a serving ring member.

join with the code -> classify NAT, probe itself -> report and link with the host -> receive
the plan -> link its ring edges -> fetch its tensors -> ring
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from kafila.engine import DTYPES
from kafila.net.edge import LinkNode, connect_edge
from kafila.net.errors import LinkAuthError, LinkError
from kafila.net.link import Link
from kafila.net.signaling import SignalingError
from kafila.net.waits import wait_at_most
from kafila.planner.devices import DeviceReport
from kafila.planner.held import Held, runs
from kafila.proto import session as sm
from kafila.proto.codes import parse_code
from kafila.proto.signaling import MemberInfo
from kafila.session.channel import LinkChannel
from kafila.session.errors import HostLeft, NoHost, SessionError
from kafila.session.forming import core as fm
from kafila.session.forming.admission import WRONG_OWN_CODE
from kafila.session.forming.core import MemberFormation
from kafila.session.forming.driver import Driver, while_signaling
from kafila.session.forming.epochs import MemberEpochs
from kafila.session.forming.links import connect_node, link_ring, named
from kafila.session.forming.measure import Measurements, observe_nats, own_measurements, probe_report
from kafila.session.forming.plans import say_ready
from kafila.session.forming.signaling import default_name, join_in_turn, reach_rendezvous, refused_by
from kafila.session.forming.takeover import Succession
from kafila.session.progress import note, off_loop, say
from kafila.session.ring.build import Serving, shard_text, start_role
from kafila.session.runtime import Listeners, MemberRuntime, formed_by, reserve_api
from kafila.session.terms import Options
from kafila.session.weights.fetch import ShardResult, fetch_shard
from kafila.session.weights.holding import held_in_cache
from kafila.session.weights.sharing import Sharing, where_from

# A spare whose host was lost joins again with the same code for up to this long: the host's
# successor takes its place at the rendezvous once it noticed the loss (the ring's bound, 3 s by
# default) and linked with the survivors; until then a join hears that the session has no host.
SUCCESSOR_WAIT_S = 60.0
REJOIN_EVERY_S = 1.0


class SpareHostLost(SessionError):
    """The host left while it kept this member as a spare: it joins again (its successor's)."""

    def __init__(self, reason: str, listeners: Listeners) -> None:
        super().__init__(reason)
        self.listeners = listeners


async def join(code_text: str, opts: Options) -> MemberRuntime:
    """Join the session of `code_text` and take this member's place in its ring; the runtime it
    returns serves until closed. A spare whose host is lost joins again with the same code, on the
    same API and metrics addresses, until the host's successor admits it (SUCCESSOR_WAIT_S)."""
    opts.check()
    loop = asyncio.get_running_loop()
    kept: Listeners | None = None  # a spare's, while it joins again
    measured = own_measurements(opts)  # its probe, which joining again under the same terms reuses
    since = 0.0
    try:
        while True:
            try:
                runtime = await formed_by("member", partial(_join, code_text, opts, kept, measured))
                kept = None  # the runtime's from now on
                return runtime
            except SpareHostLost as exc:
                kept, since = exc.listeners, loop.time()
                say(f"{exc}; joining again with the same code (the host's successor takes its place)")
            except NoHost:
                if kept is None or loop.time() - since > SUCCESSOR_WAIT_S:
                    raise
            await asyncio.sleep(REJOIN_EVERY_S)
    finally:
        if kept is not None:
            await kept.close()


def _link_host(node: LinkNode, name: str, host: MemberInfo, held: MemberRuntime) -> asyncio.Future[Link]:
    """A joining member's control link with the host, formed as it joins (the host links with
    it as it hears of the join, while both measure themselves): the host admits the member once
    the link authenticated (kafila.session.forming.admission). Closed if forming fails."""

    def formed(job: asyncio.Future[Link]) -> None:
        if job.cancelled() or job.exception() is not None:
            return
        held.links[host.name] = job.result()
        doing = held.forming.step  # still measuring itself, or waiting for the host's plan
        say(f"linked with the host {host.name} ({job.result().path}); it checked this member's code")
        note(doing)

    job = asyncio.ensure_future(named(name, host.name, connect_edge(node, host.id, True)))
    job.add_done_callback(formed)
    held.tasks.append(job)
    return job


def in_session_formats(opts: Options, capability: dict[str, Any]) -> Options:
    """A joining member's options with the session's dtype and weight format from the host's
    capability (what it probes in; the plan's terms repeat them for the stage). A host that names
    none leaves "auto"."""
    dtype, quant = capability.get("dtype"), capability.get("quant")
    if dtype is not None and dtype not in DTYPES:
        raise SessionError(f"the host asks for dtype {dtype!r}, none of {sorted(DTYPES)}")
    if quant is not None and quant not in sm.SESSION_QUANTS:
        raise SessionError(f"the host asks for weight format {quant!r}, none of {list(sm.SESSION_QUANTS)}")
    return replace(opts, dtype=dtype or "auto", quant=quant or "auto")


async def tell_host_and_wait(drive: Driver, host_id: int, reason: str, within: float = 5.0) -> None:
    """Say why this member cannot go on, and stay until the host's refusal comes back (up to
    `within` s): the rendezvous may tell the host that this member left before it forwards the
    message, and the host would then name only the leaving."""
    with contextlib.suppress(SignalingError, SessionError, TimeoutError):
        await drive.client.signal(host_id, sm.Failed(reason).body())
        await wait_at_most(drive.until(fm.Formed), within)  # ends with the host's refusal


async def host_verdict(drive: Driver, within: float = 5.0) -> None:
    """A member whose control link failed stays until the host's refusal comes (up to `within` s),
    which ends the attempt with the host's reason (SessionError); the host, told first, names why
    instead of reading only that the member left."""
    with contextlib.suppress(TimeoutError):
        await wait_at_most(drive.until(fm.Formed), within)


async def _join(
    code_text: str, opts: Options, kept: Listeners | None, measured: Measurements, held: MemberRuntime
) -> None:
    code = held.code = parse_code(code_text)
    if kept is None:
        held.api_socket = reserve_api(opts)
        held.open_metrics(opts.metrics)
    else:  # joining again: the listeners stay join()'s until this attempt forms
        held.borrow_listeners(kept)
    client = held.client = await reach_rendezvous(opts.rendezvous)
    with refused_by(opts.rendezvous, f"join session {code.public}"):
        joined = await join_in_turn(
            client, code, opts.name or default_name(), {"role": "member"}, opts.wait_s
        )
    host_info = next((m for m in joined.members if m.host), None)
    if host_info is None:  # its host left; members still in it keep the code alive
        raise NoHost(f"session {code.public} has no host any more; ask for a new session code")
    name = f"{opts.name or default_name()}-{joined.member}" if opts.name is None else opts.name
    held.name = held.forming.name = name
    held.forming.model = joined.model
    held.forming.session, held.forming.members_expected = code.public, joined.members_expected
    say(f"joined session {code.public} for model {joined.model} ({len(joined.members)} member(s) so far)")
    await held.open_api(opts.api_security, opts.api_limits)
    node = held.node = await connect_node(client, code, opts.rendezvous)
    pump = asyncio.ensure_future(node.signals.pump())
    held.tasks.append(pump)
    config = host_info.capability.get("config")  # the model's shape, for the block probe
    opts = in_session_formats(opts, host_info.capability)  # probe as the session will compute
    config = config if isinstance(config, dict) else None
    core = MemberFormation(host_id=host_info.id, me_id=node.member, wait_s=opts.wait_s, link_s=opts.wait_s)
    drive = held.driver = Driver(core, client, node.signals)
    drive.on_spare = lambda spared: held.serve_as_spare(host_info.name, spared.reason)
    control = _link_host(node, name, host_info, held)  # the host checks this member's code meanwhile
    try:
        checkpoint = host_info.capability.get("checkpoint")  # what its cache holds of it goes with the probe
        ckpt = checkpoint if isinstance(checkpoint, str) else None
        measuring = _with_held(off_loop(probe_report, name, node.nat, opts, config, measured), opts, ckpt)
        probing = while_signaling(measuring, pump, control)
        me = await drive.during(probing)  # the driver hears the host's refusal (or leaving) meanwhile
        got = await drive.until(fm.LinkNow, core.start(me, drive.now()), watch=control)
        host_link = await drive.during(control)  # done by now: the host plans with admitted members
    except HostLeft as exc:
        if held.forming.spare is None:
            raise
        held.listeners_borrowed = True  # join() keeps them for the next attempt
        why = f"the host {host_info.name} left while it kept this member as a spare"
        raise SpareHostLost(why, Listeners(held.api, held.metrics)) from exc
    except LinkAuthError as exc:
        await host_verdict(drive)  # the host's refusal names why, and it hears of this before the leaving
        raise SessionError(
            f"the host did not admit this member: {WRONG_OWN_CODE}; join "
            f"again with the exact code the host printed ({exc})"
        ) from exc
    except LinkError as exc:
        await host_verdict(drive)
        raise SessionError(f"this member could not link with the host: {exc}") from exc
    held.name, held.host, held.plan = got.me, got.host, got.plan
    nats = observe_nats([replace(me, name=got.me)])  # its own: the host knows the others'
    try:
        ring_links = link_ring(node, got.plan, got.me, got.ids, got.host, {host_info.id: host_link})
        links = held.links = await drive.during(ring_links)
    except LinkError as exc:  # e.g. a wrong secret word: the others would only see it leave
        await tell_host_and_wait(drive, host_info.id, f"could not link: {exc}")
        raise
    await drive.carry(core.linked(drive.now()))
    opts = replace(opts, dtype=got.terms.dtype, quant=got.terms.quant)  # the host's, whatever the probe used
    mirror = opts.weights_from or host_info.capability.get("weights_from")
    sharing = held.weights = Sharing(
        opts.cache, mirror if isinstance(mirror, str) else None, opts.replica_bytes
    )
    sharing.attach(links)  # the others may ask for what this member holds from now on
    shard = await drive.during(
        _fetch(got, links, opts, sharing)
    )  # in the plan's epoch, as the host serves it
    held.shard = shard
    await drive.carry(core.fetched(drive.now()))
    serving = Serving(got.terms, shard.checkpoint, got.alternatives, weights_doc(shard), nats)
    ring = start_role(
        got.me, code, got.plan, shard.path, links, opts, serving, held.api is not None, got.epoch, got.origins
    )
    held.role, held.app = await drive.during(ring)
    held.ring().succession = got.succession
    held.watch_host_ending()
    sharing.keep_replicas(got.plan, got.me, links, got.host)  # after its own shard, in the background
    local: list[Path] | None = None if opts.use_local else []
    epochs = MemberEpochs(held, got.ids, opts, serving, local, dict(got.origins), dict(got.probes))
    epochs.start()  # the host's re-plans, once formed
    Succession(held, epochs, drive).start()  # and, should the host be lost, its successor's
    await drive.until(fm.Formed, core.started(drive.now()))  # refused / left / timeout: SessionError
    held.tasks.append(asyncio.ensure_future(drive.serve_formed(held.links, held.ring().info.rendezvous)))
    held.serve_session_api()
    say_ready(got.plan)


async def _with_held(
    measuring: Awaitable[DeviceReport], opts: Options, checkpoint: str | None
) -> DeviceReport:
    """This member's report with what its weight cache holds of the session's `checkpoint` (looked
    at after the probe: a blob hashed again beside it would slow its timings)."""
    me = await measuring
    have = await off_loop(held_in_cache, opts.cache, checkpoint)
    if not have.empty:
        say(f"{me.name}: its weight cache holds {held_text(have)} of this session's checkpoint")
    return replace(me, held=have)


def held_text(h: Held) -> str:
    """`blocks 10-35 and the head`."""
    parts = [f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in runs(h.blocks)]
    said = f"block{'s' if len(h.blocks) > 1 else ''} {', '.join(parts)}" if parts else ""
    return " and ".join(x for x in (said, "the head" if h.head else "") if x)


async def _fetch(got: fm.LinkNow, links: dict[str, Link], opts: Options, sharing: Sharing) -> ShardResult:
    a, b = got.plan.block_range(got.me)
    head = got.plan.head == got.me
    local: list[Path] | None = None if opts.use_local else []
    channel = LinkChannel(links[got.host], got.host, got.epoch)
    blocks = shard_text(a, b, head)
    note(f"getting the weights of {blocks}")
    shard = await fetch_shard(
        channel,
        range(a, b),
        head,
        cache=opts.cache,
        local=local,
        label=got.me,
        sources=sharing.sources(links, got.host),
        on_manifest=sharing.known,
    )
    say(f"weights for {blocks}: {weights_source(shard)}")
    if shard.local:
        sharing.local_copy(shard.path)
    return shard


def weights_doc(shard: ShardResult) -> dict[str, Any]:
    """Where a member's shard came from, for its /session: its own copy, the cache, or the host."""
    source = "local copy" if shard.local else "fetched" if shard.fetched else "cache"
    return {
        "source": source,
        "path": str(shard.path),
        "tensors": len(shard.tensors),
        "fetched_tensors": len(shard.fetched),
        "fetched_bytes": shard.bytes_fetched,  # over the link: tensors, headers and small files
        "fetched_tensor_bytes": shard.tensor_bytes,  # the tensors alone, as the console's "MB fetched"
        "fetched_by_source": dict(shard.kinds),  # peer, mirror, host -> bytes
    }


def weights_source(shard: ShardResult) -> str:
    """Where a member's shard came from, for the person watching."""
    if shard.local:
        return f"this machine's own copy of the checkpoint ({shard.path}), nothing fetched"
    cached = len(shard.tensors) - len(shard.fetched)
    if not shard.fetched:
        return f"all {cached} tensors from the local cache, nothing fetched"
    # the whole of what the progress bar counted: tensors, and the headers and small files
    fetched = (
        f"{shard.bytes_fetched / 1e6:.1f} MB fetched from {where_from(shard)} ({len(shard.fetched)} tensors"
    )
    fetched += f", {shard.meta_bytes / 1e6:.1f} MB of headers and files)" if shard.meta_bytes else ")"
    return fetched + (f", {cached} tensors from the local cache" if cached else "")
