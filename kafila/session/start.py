"""host and join: the two ways into a session (see kafila.session.form for the steps)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kafila.engine import DTYPES
from kafila.engine.backend import checkpoint_dtype
from kafila.models.checkpoint import Checkpoint
from kafila.net.errors import LinkAuthError, LinkError
from kafila.net.link import Link, PathChange
from kafila.net.signaling import SignalingClient, SignalingError, unreachable_reason
from kafila.obs import metrics
from kafila.obs.log import get_logger
from kafila.obs.trace import TraceLog
from kafila.planner.devices import DeviceReport
from kafila.planner.plan import Plan
from kafila.proto.codes import SessionCode, new_code, parse_code
from kafila.session import formation as fm
from kafila.session.admission import WRONG_OWN_CODE, Admission
from kafila.session.channel import Heartbeat, LinkChannel, blames
from kafila.session.form import (
    DEFAULT_RENDEZVOUS,
    Driver,
    Formed,
    Options,
    SessionError,
    connect_node,
    default_name,
    fmt_plans,
    link_ring,
    note,
    off_loop,
    probe_report,
    progress_to,
    say,
    session_record,
    while_signaling,
)
from kafila.session.formation import HostFormation, MemberFormation
from kafila.session.schedule import lanes_for

if TYPE_CHECKING:
    from kafila.api.server import ApiServer
    from kafila.session.head import RingInfo
    from kafila.session.weights import ShardResult

log = get_logger("kafila.session")


class Held:
    """What a member holds while its session forms, released if forming fails."""

    def __init__(self, role: str) -> None:
        from kafila.api.forming import FormingStatus

        self.forming = FormingStatus(role)  # what its API's /session says until the ring serves
        self.client: SignalingClient | None = None
        self.node: Any = None
        self.tasks: list[asyncio.Task[Any]] = []
        self.links: dict[str, Link] = {}
        self.driver: Driver | None = None
        self.admission: Admission | None = None  # the host's links with members that reported
        self.formed: Formed | None = None  # the ring role and API, once started
        self.api_socket: socket.socket | None = None  # the API's address, bound before anything else
        self.api: ApiServer | None = None  # serving on it: 503 "forming" until the session formed

    async def release(self) -> None:
        if self.driver is not None:
            self.driver.close()
        if self.admission is not None:
            await self.admission.close("session not formed")
        if self.formed is not None:  # e.g. the host's members never became ready
            self.formed.service.on_broken = None  # closing its links is not a ring breaking
            with contextlib.suppress(Exception):
                await self.formed.service.stop()
            self.formed.service.model.close()
        for link in self.links.values():
            with contextlib.suppress(Exception):
                await link.close("session not formed")
        for task in self.tasks:
            task.cancel()
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close("session not formed")
        if self.node is not None:
            self.node.endpoint.close()
        if self.api is not None:
            with contextlib.suppress(Exception):
                await self.api.stop()
        if self.api_socket is not None:
            self.api_socket.close()


async def host(opts: Options, on_code: Callable[[SessionCode], None] | None = None) -> Formed:
    held = Held("host")
    try:
        with progress_to(held.forming.tell):
            return await _host(opts, on_code, held)
    except BaseException:
        await asyncio.shield(held.release())
        raise


async def join(code_text: str, opts: Options) -> Formed:
    held = Held("member")
    try:
        with progress_to(held.forming.tell):
            return await _join(code_text, opts, held)
    except BaseException:
        await asyncio.shield(held.release())
        raise


def reserve_api(opts: Options) -> socket.socket | None:
    """This member's API address (--api), bound before the session forms: a taken port or an
    address this machine does not have is named now, not after probing, planning and loading."""
    from kafila.api.server import parse_addr
    from kafila.net.tcp import bind_tcp

    if opts.api is None:
        return None
    host, port = parse_addr(opts.api)
    try:
        sock = bind_tcp(host, port)
    except OSError as exc:
        raise SessionError(
            f"cannot serve the API on {host}:{port}: {exc.strerror or exc} "
            "(choose another with --api HOST:PORT, or --api off)"
        ) from exc
    if not _loopback(host):
        say(
            f"note: the API on {host}:{port} is open to other machines and has no authentication: "
            "whoever reaches it uses this session (the default, 127.0.0.1, keeps it to this machine)"
        )
    return sock


def _loopback(host: str) -> bool:
    """Whether an --api host is this machine alone (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


async def open_api(held: Held) -> None:
    """Serve this member's API on the address reserved at its start (--api; none with --api off):
    while the session forms, /session says what the member is doing and every other route answers
    503 (kafila.api.forming)."""
    from kafila.api.forming import forming_app
    from kafila.api.server import ApiServer

    if held.api_socket is None:
        return
    sock, held.api_socket = held.api_socket, None  # the server's from now on, closed with it
    try:
        held.api = await ApiServer(forming_app(held.forming), sock).start()
    except BaseException:
        sock.close()
        raise
    url = held.api.url
    say(f"API at {url} (503 until the session is ready; {url}/session says how forming goes)")


def join_command(code: SessionCode, rendezvous: str) -> str:
    """What a member types to join: the rendezvous named unless it is the default."""
    where = "" if rendezvous == DEFAULT_RENDEZVOUS else f" --rendezvous {rendezvous}"
    return f"kafila join {code}{where}"


async def reach_rendezvous(url: str) -> SignalingClient:
    """The signaling connection, or a SessionError naming the URL and why it failed."""
    from websockets.exceptions import WebSocketException

    try:
        return await SignalingClient.connect(url)
    except (OSError, TimeoutError, WebSocketException) as exc:
        why = unreachable_reason(exc)
        raise SessionError(
            f"cannot reach the rendezvous at {url}: {why} (is `kafila rendezvous` running there? "
            "choose another with --rendezvous URL)"
        ) from exc


@contextlib.contextmanager
def refused_by(url: str, what: str) -> Iterator[None]:
    """A request the rendezvous refuses becomes a SessionError naming what was asked and why."""
    try:
        yield
    except SignalingError as exc:
        hint = ""
        if exc.code == "unknown_session":  # a mistyped code, or another rendezvous than the host's
            hint = "; the host printed the whole join command, with its --rendezvous unless the default"
        raise SessionError(
            f"the rendezvous at {url} would not {what}: {exc.message} ({exc.code}){hint}"
        ) from exc


async def _host(opts: Options, on_code: Callable[[SessionCode], None] | None, held: Held) -> Formed:
    from kafila.models.registry import resolve, served_name

    folder = resolve(opts.model)
    ckpt = Checkpoint.open(folder, complete=True)
    ckpt.config.check_context(opts.context, opts.model)
    if opts.members > (blocks := ckpt.config.num_hidden_layers):  # known now, not after N joined
        raise SessionError(
            f"--members {opts.members} is more than the {blocks} blocks of {opts.model}: every member "
            f"holds at least one; at most {blocks} members"
        )
    # one dtype for the whole session, decided here: every member probes and computes in it; and
    # one model name, which clients anywhere use (a folder's own name, not this machine's path)
    opts = replace(opts, dtype=checkpoint_dtype(opts.dtype, ckpt.stored_dtype), model=served_name(opts.model))
    name = held.forming.name = opts.name or default_name()
    held.forming.model = opts.model
    held.api_socket = reserve_api(opts)
    client = held.client = await reach_rendezvous(opts.rendezvous)
    config = ckpt.config.raw if len(json.dumps(ckpt.config.raw)) < 12_000 else None
    capability = {"role": "host", "config": config, "dtype": opts.dtype}
    with refused_by(opts.rendezvous, "open a session"):
        opened = await client.open_session(opts.model, opts.members, name, capability)
    code = new_code(opened.session)
    say(f"session code: {code}   (members join with: {join_command(code, opts.rendezvous)})")
    await open_api(held)
    if opts.wait_s > opened.expires_in:  # the rendezvous's --code-ttl-s is shorter than --wait
        say(
            f"note: the rendezvous takes joins with this code for {opened.expires_in:.0f} s after it "
            f"opened or was last joined, less than --wait {opts.wait_s:.0f} s: members must join within that"
        )
    if on_code:
        on_code(code)
    node = held.node = await connect_node(client, code, opts.rendezvous)
    pump = asyncio.ensure_future(node.signals.pump())
    held.tasks.append(pump)
    core = HostFormation(members=opts.members, wait_s=opts.wait_s, host_id=node.member, host_name=name)
    drive = held.driver = Driver(core, client, node.signals)
    admission = held.admission = Admission(node, name, drive)
    # members that join meanwhile are linked with, and so their codes checked, while this host measures
    me = await drive.during(while_signaling(off_loop(probe_report, name, node, opts, config), pump))
    gathered = await drive.until(fm.PlanNow, core.start(me, drive.now()))
    control = admission.take(gathered.ids.values())  # every other member's link, admitted
    try:
        plan, alternatives = _plan(list(gathered.devices), ckpt, opts)
    except SessionError as exc:
        await drive.carry(core.refuse(str(exc), drive.now()))
        raise
    extra = {"model": opts.model, "chunk": opts.chunk, "queue": opts.queue, "dtype": opts.dtype}
    extra["alternatives"] = alternatives
    await drive.carry(core.planned(plan, drive.now(), **extra))
    ring = _host_ring(name, code, plan, folder, gathered.ids, control, node, client, opts, held, alternatives)
    try:
        formed = held.formed = await drive.during(ring)
    except LinkError as exc:  # e.g. a member's wrong secret word: the members are told, not left
        await drive.carry(core.link_failed(f"the host could not link: {exc}", drive.now()))
        raise
    formed.tasks.append(pump)
    await drive.until(fm.Formed, core.started(drive.now()))
    formed.tasks.append(asyncio.ensure_future(drive.serve_formed(formed)))
    serve_session_api(formed)
    say_ready(plan)
    return formed


def say_ready(plan: Plan) -> None:
    """Every member's last line of forming (the host's is what `kafila demo` waits for)."""
    n = len(plan.order)
    say(f"session ready: {n} member{'s' if n > 1 else ''}, head {plan.head}, ring {' -> '.join(plan.order)}")


async def _host_ring(
    name: str,
    code: SessionCode,
    plan: Plan,
    folder: Path,
    ids: dict[str, int],
    control: dict[int, Link],
    node: Any,
    client: SignalingClient,
    opts: Options,
    held: Held,
    alternatives: dict[str, Any],
) -> Formed:
    """The host's links (its `control` links with every member, formed as they were admitted, are
    its ring edges too), weight serving and ring role (a step the formation core waits on)."""
    from kafila.session.weights import WeightServer, checkpoint_id

    links = held.links = await link_ring(node, plan, name, ids, name, control)
    server = WeightServer(folder, cache=opts.cache)
    controls = [LinkChannel(link, peer) for peer, link in links.items()]
    if controls:
        say(f"serving weights to {len(controls)} member(s)")

    async def serve(channel: LinkChannel) -> None:
        if (error := (await server.serve(channel)).error) is not None:  # the host says why it will leave
            say(f"{channel.peer} could not take its weights: {error}")

    await asyncio.gather(*(serve(c) for c in controls))
    digest = await off_loop(checkpoint_id, folder)
    own = {"source": "own files", "path": str(folder), "fetched_bytes": 0, "fetched_tensor_bytes": 0}
    serving = Serving(opts.model, opts.chunk, opts.queue, digest, alternatives, own)
    formed = await _start_ring(name, code, plan, folder, links, node, client, opts, serving, held.api)
    formed.host = name
    return formed


def _link_host(node: Any, name: str, host: Any, held: Held) -> asyncio.Future[Link]:
    """A joining member's control link with the host, formed as it joins (the host links with
    it as it hears of the join, while both measure themselves): the host admits the member once
    the link authenticated (kafila.session.admission). Closed if forming fails."""
    from kafila.net.edge import connect_edge
    from kafila.session.form import named

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


def in_session_dtype(opts: Options, capability: dict[str, Any]) -> Options:
    """A joining member's options with the session's dtype from the host's capability (what it
    probes in; the plan repeats it for the stage). A host that names none leaves "auto"."""
    dtype = capability.get("dtype")
    if dtype is None:
        return replace(opts, dtype="auto")
    if dtype not in DTYPES:
        raise SessionError(f"the host asks for dtype {dtype!r}, none of {sorted(DTYPES)}")
    return replace(opts, dtype=dtype)


async def tell_host_and_wait(drive: Driver, host_id: int, reason: str, within: float = 5.0) -> None:
    """Say why this member cannot go on, and stay until the host's refusal comes back (up to
    `within` s): the rendezvous may tell the host that this member left before it forwards the
    message, and the host would then name only the leaving."""
    with contextlib.suppress(SignalingError, SessionError, TimeoutError):
        await drive.client.signal(host_id, fm.payload("failed", reason=reason))
        await asyncio.wait_for(drive.until(fm.Formed), within)  # ends with the host's refusal


async def host_verdict(drive: Driver, within: float = 5.0) -> None:
    """A member whose control link failed stays until the host's refusal comes (up to `within` s),
    which ends the attempt with the host's reason (SessionError); the host, told first, names why
    instead of reading only that the member left."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(drive.until(fm.Formed), within)


def _plan(devices: list[DeviceReport], ckpt: Checkpoint, opts: Options) -> tuple[Plan, dict[str, Any]]:
    from kafila.planner.decide import plan_all

    manifest = ckpt.manifest(DTYPES[opts.dtype])  # priced in the session's dtype
    plans = plan_all(
        devices,
        manifest,
        context=opts.context,
        concurrency=opts.concurrency,
        anchor=0,
        objective=opts.objective,
    )
    say("plans for this session (predicted):\n" + fmt_plans(plans))
    plan = plans[opts.division]
    if not plan.feasible:
        raise SessionError(f"the session cannot be formed with the {opts.division} division: {plan.reason}")
    return plan, {name: p.summary() for name, p in plans.items()}


async def _join(code_text: str, opts: Options, held: Held) -> Formed:
    code = parse_code(code_text)
    held.api_socket = reserve_api(opts)
    client = held.client = await reach_rendezvous(opts.rendezvous)
    with refused_by(opts.rendezvous, f"join session {code.public}"):
        joined = await client.join(code.public, opts.name or default_name(), {"role": "member"})
    host_info = next((m for m in joined.members if m.host), None)
    if host_info is None:  # its host left; members still in it keep the code alive
        raise SessionError(f"session {code.public} has no host any more; ask for a new session code")
    name = f"{opts.name or default_name()}-{joined.member}" if opts.name is None else opts.name
    held.forming.name, held.forming.model = name, joined.model
    say(f"joined session {code.public} for model {joined.model} ({len(joined.members)} member(s) so far)")
    await open_api(held)
    node = held.node = await connect_node(client, code, opts.rendezvous)
    pump = asyncio.ensure_future(node.signals.pump())
    held.tasks.append(pump)
    config = host_info.capability.get("config")  # the model's shape, for the block probe
    opts = in_session_dtype(opts, host_info.capability)  # probe as the session will compute
    config = config if isinstance(config, dict) else None
    core = MemberFormation(host_id=host_info.id, me_id=node.member, wait_s=opts.wait_s, link_s=opts.wait_s)
    drive = held.driver = Driver(core, client, node.signals)
    control = _link_host(node, name, host_info, held)  # the host checks this member's code meanwhile
    try:
        probing = while_signaling(off_loop(probe_report, name, node, opts, config), pump, control)
        me = await drive.during(probing)  # the driver hears the host's refusal (or leaving) meanwhile
        got = await drive.until(fm.LinkNow, core.start(me, drive.now()), watch=control)
        host_link = await drive.during(control)  # done by now: the host plans with admitted members
    except LinkAuthError as exc:
        await host_verdict(drive)  # the host's refusal names why, and it hears of this before the leaving
        raise SessionError(
            f"the host did not admit this member: {WRONG_OWN_CODE}; join "
            f"again with the exact code the host printed ({exc})"
        ) from exc
    except LinkError as exc:
        await host_verdict(drive)
        raise SessionError(f"this member could not link with the host: {exc}") from exc
    try:
        ring_links = link_ring(node, got.plan, got.me, got.ids, got.host, {host_info.id: host_link})
        links = held.links = await drive.during(ring_links)
    except LinkError as exc:  # e.g. a wrong secret word: the others would only see it leave
        await tell_host_and_wait(drive, host_info.id, f"could not link: {exc}")
        raise
    await drive.carry(core.linked(drive.now()))
    opts = replace(opts, dtype=got.dtype)  # compute in the host's choice, whatever the probe used
    shard = await drive.during(_fetch(got, links, opts))
    await drive.carry(core.fetched(drive.now()))
    serving = Serving(got.model, got.chunk, got.queue, shard.checkpoint, got.alternatives, weights_doc(shard))
    ring = _start_ring(got.me, code, got.plan, shard.path, links, node, client, opts, serving, held.api)
    formed = held.formed = await drive.during(ring)
    formed.tasks.append(pump)
    formed.shard = shard  # type: ignore[attr-defined]
    formed.host = got.host
    watch_host_ending(formed)
    await drive.until(fm.Formed, core.started(drive.now()))  # refused / left / timeout: SessionError
    formed.tasks.append(asyncio.ensure_future(drive.serve_formed(formed)))
    serve_session_api(formed)
    say_ready(got.plan)
    return formed


async def _fetch(got: fm.LinkNow, links: dict[str, Link], opts: Options) -> Any:
    from kafila.session.weights import fetch_shard

    a, b = got.plan.block_range(got.me)
    head = got.plan.head == got.me
    local: list[Path] | None = None if opts.use_local else []
    channel = LinkChannel(links[got.host], got.host)
    blocks = shard_text(a, b, head)
    note(f"getting the weights of {blocks}")
    shard = await fetch_shard(channel, range(a, b), head, cache=opts.cache, local=local, label=got.me)
    say(f"weights for {blocks}: {weights_source(shard)}")
    return shard


def shard_text(a: int, b: int, head: bool) -> str:
    """A member's share for the person watching: "blocks [0, 9) + head"."""
    return f"blocks [{a}, {b})" + (" + head" if head else "")


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
    }


def weights_source(shard: ShardResult) -> str:
    """Where a member's shard came from, for the person watching."""
    if shard.local:
        return f"this machine's own copy of the checkpoint ({shard.path}), nothing fetched"
    cached = len(shard.tensors) - len(shard.fetched)
    if not shard.fetched:
        return f"all {cached} tensors from the local cache, nothing fetched"
    # the whole of what the progress bar counted: tensors, and the headers and small files
    fetched = f"{shard.bytes_fetched / 1e6:.1f} MB fetched from the host ({len(shard.fetched)} tensors"
    fetched += f", {shard.meta_bytes / 1e6:.1f} MB of headers and files)" if shard.meta_bytes else ")"
    return fetched + (f", {cached} tensors from the local cache" if cached else "")


@dataclass(frozen=True)
class Serving:
    """What the host decided for every member's ring role and API."""

    model: str  # the model id clients ask for
    chunk: int  # prompt tokens per prefill step
    queue: int  # requests that may wait for a slot at the head
    checkpoint: str  # the checkpoint id (its safetensors headers' digest): the Ollama digest
    alternatives: dict[str, Any] | None = None  # the divisions compared, for /session
    weights: dict[str, Any] | None = None  # where this member's shard came from, for /session


async def _start_ring(
    name: str,
    code: SessionCode,
    plan: Plan,
    folder: Path,
    links: dict[str, Link],
    node: Any,
    client: SignalingClient,
    opts: Options,
    serving: Serving,
    api: ApiServer | None = None,
) -> Formed:
    from kafila.api.state import ModelFacts
    from kafila.engine.stage import Stage
    from kafila.engine.tokenizer import Tokenizer
    from kafila.session.compute import ModelThread
    from kafila.session.head import RingHead
    from kafila.session.member import RingMember

    model = serving.model
    ckpt = Checkpoint.open(folder)  # a member's shard: its own tensors only
    tokenizer = Tokenizer.from_checkpoint(ckpt)
    a, b = plan.block_range(name)
    index, order = plan.order.index(name), list(plan.order)
    head = plan.head == name
    note(f"loading {shard_text(a, b, head)} into memory")
    stage = await off_loop(
        Stage.load,
        ckpt,
        range(a, b),
        head,
        opts.backend,
        opts.dtype,
        plan.context,
        plan.concurrency,
        opts.pace,
    )
    nxt_name, prv_name = plan.successor(name), plan.predecessor(name)
    info = _ring_info(name, code, plan, links, serving, stage.backend.dtype)
    info.rendezvous.update(url=opts.rendezvous, state="connected")
    nxt = _channel(links.get(nxt_name), nxt_name, opts)
    prv = _channel(links.get(prv_name), prv_name, opts) if len(order) > 2 or nxt is None else nxt
    traces = TraceLog(opts.trace)  # without a file: the last records for /traces only
    model_thread = ModelThread(name)
    if head:
        lanes = lanes_for(plan.circuit_s, plan.bottleneck_s, len(order))
        service: Any = RingHead(
            stage,
            model_thread,
            info,
            nxt,
            prv,
            tuple(tokenizer.stop_ids),
            plan.concurrency,
            serving.chunk,
            traces,
            lanes,
            serving.queue,
        )
        traces.write(session_record(plan, code.public, model, info.edges))
    else:
        service = RingMember(index, stage, model_thread, info, nxt, prv, traces)  # type: ignore[arg-type]
    metrics.observe_session(session_record(plan, code.public, model, info.edges), ring_view=head)
    service.on_broken = lambda why: say(broken_line(name, why))
    service.start()
    facts = ModelFacts.of(ckpt.config, stage.backend.wire_dtype, serving.checkpoint)
    formed = Formed(name, code, plan, service, api, client, node, links)
    if api is not None:  # served once the whole session has formed (serve_session_api)
        formed.app = _session_app(service, tokenizer, model, facts, traces)
    else:  # the API's line is the others' "ready"
        say(f"serving {shard_text(a, b, head)}; no API on this member (--api off)")
    return formed


def broken_line(name: str, why: str) -> str:
    """What member `name` says when its ring broke for `why`."""
    if blames(why, name):  # the others' view of this member, which heard their "broken" on waking
        why += (
            ": that is this member, whose process did not run in time (stopped, asleep or swapping), "
            "so the others counted it gone"
        )
    return (
        f"{why}. This member answers requests with 503 from now on; re-planning is not implemented: "
        "end it (Ctrl-C) and form a new session"
    )


def watch_host_ending(formed: Formed) -> None:
    """A joining member ends when the host ends the session on purpose: one of its links closes as
    LinkEnded (the host's, or a member's that ended because the host did), or a neighbour's
    "broken" that says so arrives first. `formed.ended` gets the line to say, and the ring's
    "broken, answering 503" is not said. A host that crashed or went silent still leaves the
    member answering 503."""
    from kafila.net.errors import LinkEnded

    formed.ended = asyncio.get_running_loop().create_future()

    def end() -> None:
        assert formed.ended is not None
        if not formed.ended.done():
            formed.service.on_broken, formed.service.ending = None, True
            formed.ended.set_result(f"the host {formed.host} ended the session; this member stops")

    def closed(link: Link) -> None:
        if isinstance(link.error, LinkEnded):
            end()

    formed.service.on_ended = end
    for link in formed.links.values():
        link.on_close.append(partial(closed, link))
        if link.closed:  # closed before the member finished forming
            closed(link)


def _ring_info(
    name: str,
    code: SessionCode,
    plan: Plan,
    links: dict[str, Link],
    serving: Serving,
    dtype: str,
) -> RingInfo:
    """What /session and the traces say of the ring, from member `name`'s side: its edges follow
    the path this member's own links are on now (ring and control), the others the plan's."""
    from kafila.session.head import RingInfo
    from kafila.session.stagetrace import planned_rtt_ms

    nxt_name, prv_name = plan.successor(name), plan.predecessor(name)
    edges = {f"{e.src}->{e.dst}": ("direct" if e.direct else "relay") for e in plan.edges}
    own = {
        f"{src}->{dst}": links[peer]
        for src, dst, peer in ((name, nxt_name, nxt_name), (prv_name, name, prv_name))
        if peer in links
    }
    own |= {f"{name}<->{peer}": link for peer, link in links.items() if peer not in (nxt_name, prv_name)}
    follow_paths(edges, own)
    return RingInfo(
        session=code.public,
        model=serving.model,
        division=plan.division,
        order=tuple(plan.order),
        blocks={s.name: (s.start, s.stop) for s in plan.stages},
        predicted_ms={s.name: (s.cost_s or 0.0) * 1e3 for s in plan.stages},
        edges=edges,
        plan={"chosen": plan.summary(), "divisions": serving.alternatives or {}},
        edge_rtt_ms=planned_rtt_ms(plan.edges),
        dtype=dtype,
        weights=serving.weights or {},
    )


def follow_paths(edges: dict[str, str], links: dict[str, Link]) -> None:
    """Keep `edges[key]` at the path `links[key]` is on ("direct" or "relay"), also after the link
    falls back to the relay or returns to its direct path, and "closed" once it is (what /session
    shows; a closed link kept showing its last path)."""
    for key, link in links.items():
        if link.path is not None:
            edges[key] = link.path.value
        link.on_path_change.append(partial(_set_path, edges, key))
        link.on_close.append(partial(edges.__setitem__, key, "closed"))


def _set_path(edges: dict[str, str], key: str, change: PathChange) -> None:
    edges[key] = change.new.value


def _channel(link: Link | None, peer: str, opts: Options) -> Heartbeat | None:
    return Heartbeat(LinkChannel(link, peer), opts.dead_after).start() if link is not None else None


def _session_app(service: Any, tokenizer: Any, model: str, facts: Any, traces: TraceLog | None) -> Any:
    from kafila.api.app import create_app
    from kafila.api.state import Api
    from kafila.session.textcodec import TokenizerCodec

    return create_app(Api(service, TokenizerCodec(tokenizer), model, facts, traces))


def serve_session_api(formed: Formed) -> None:
    """Once every member is ready, the forming API becomes the session's: the next request gets the
    full app, on the same address (/session says "serving" only now)."""
    server = formed.api
    if server is not None and formed.app is not None:
        server.switch(formed.app)
        say(f"API at {server.url} (OpenAI {server.url}/v1, Ollama {server.url}/api, {server.url}/session)")
