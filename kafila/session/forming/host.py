"""host: open a session, gather the members, plan, link, serve the weights and start the ring.

open the session at the rendezvous -> print the code -> classify NAT, probe itself -> wait for
N-1 members' reports, linking with each as it reports (the control link, whose authentication
admits it; kafila.session.forming.admission) -> plan (or refuse, naming the device) -> send the
plan -> link the plan's other edges -> serve weights -> ring
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from kafila.engine import DTYPES
from kafila.engine.backend import checkpoint_dtype
from kafila.engine.stage import StageError, resolve_quant
from kafila.models.cache import models_dir
from kafila.models.checkpoint import Checkpoint
from kafila.models.registry import resolve, served_name
from kafila.net.errors import LinkError
from kafila.net.link import Link
from kafila.obs.log import get_logger
from kafila.planner.fetching import after_plan
from kafila.planner.replan import Membership, PlanTerms, measured_reports
from kafila.proto.codes import SessionCode, new_code
from kafila.proto.session import SessionTerms
from kafila.session.channel import LinkChannel
from kafila.session.errors import SessionError
from kafila.session.forming import core as fm
from kafila.session.forming.admission import Admission
from kafila.session.forming.arrivals import HostArrivals
from kafila.session.forming.core import HostFormation
from kafila.session.forming.driver import Driver, while_signaling
from kafila.session.forming.epochs import HostEpochs
from kafila.session.forming.links import connect_node, link_ring, measured_paths
from kafila.session.forming.measure import observe_nats, own_measurements, probe_report
from kafila.session.forming.plans import choose_plan, say_ready, session_manifest, with_measured_paths
from kafila.session.forming.signaling import default_name, join_command, reach_rendezvous, refused_by
from kafila.session.progress import off_loop, say
from kafila.session.ring.build import Serving, start_role
from kafila.session.runtime import MemberRuntime, formed_by, reserve_api
from kafila.session.terms import Options
from kafila.session.weights.manifest import checkpoint_id
from kafila.session.weights.mirror import fetch_checkpoint, needs_fetching
from kafila.session.weights.server import WeightServer
from kafila.session.weights.sharing import Sharing

log = get_logger("kafila.session")


async def host(opts: Options, on_code: Callable[[SessionCode], None] | None = None) -> MemberRuntime:
    """Open a session and form its ring; the runtime it returns serves until closed."""
    opts.check()
    return await formed_by("host", partial(_host, opts, on_code))


async def _host(opts: Options, on_code: Callable[[SessionCode], None] | None, held: MemberRuntime) -> None:
    if opts.weights_from is not None and needs_fetching(opts.model):  # a host that starts from a mirror
        say(f"fetching {opts.model} from {opts.weights_from} into {models_dir() / opts.model}")
        await fetch_checkpoint(opts.weights_from, models_dir() / opts.model)
    folder = resolve(opts.model, quant=opts.quant)  # the default model in q4: its GGUF's packed blocks
    ckpt = Checkpoint.open(folder, complete=True)
    ckpt.config.check_context(opts.context, opts.model)
    if opts.members > (blocks := ckpt.config.num_hidden_layers):  # known now, not after N joined
        raise SessionError(
            f"--members {opts.members} is more than the {blocks} blocks of {opts.model}: every member "
            f"holds at least one; at most {blocks} members"
        )
    # one dtype and one weight format for the whole session, decided here: every member probes,
    # loads and computes in them; and one model name, which clients anywhere use (a folder's own
    # name, not this machine's path)
    dtype, quant = checkpoint_dtype(opts.dtype, ckpt.stored_dtype), session_quant(opts.quant, ckpt)
    opts = replace(opts, dtype=dtype, quant=quant, model=served_name(opts.model))
    name = held.name = held.host = held.forming.name = opts.name or default_name()
    held.forming.model = opts.model
    held.api_socket = reserve_api(opts)
    held.open_metrics(opts.metrics)
    client = held.client = await reach_rendezvous(opts.rendezvous)
    config = ckpt.config.raw if len(json.dumps(ckpt.config.raw)) < 12_000 else None
    capability = {"role": "host", "config": config, "dtype": opts.dtype, "quant": opts.quant}
    # the checkpoint's id: a joining member reports what its cache holds of it (the plan prefers
    # members fetching from each other to fetching from this host)
    capability["checkpoint"] = await off_loop(checkpoint_id, folder)
    if opts.weights_from is not None:  # members fetch from it before asking this host
        capability["weights_from"] = opts.weights_from
    with refused_by(opts.rendezvous, "open a session"):
        opened = await client.open_session(opts.model, opts.members, name, capability)
        code = held.code = new_code(opened.session)
        held.forming.session, held.forming.members_expected = code.public, opts.members  # its metrics' labels
        await client.protect(code)  # joins prove the code's secret to the rendezvous from now on
    say(f"session code: {code}   (members join with: {join_command(code, opts.rendezvous)})")
    await held.open_api(opts.api_security, opts.api_limits)
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
    measuring = off_loop(probe_report, name, node.nat, opts, config, own_measurements(opts))
    me = await drive.during(while_signaling(measuring, pump))
    gathered = await drive.until(fm.PlanNow, core.start(me, drive.now()))
    control = admission.take(gathered.ids.values())  # every other member's link, admitted
    nats = observe_nats(gathered.devices)
    terms = opts.terms()
    measured = await measured_paths(name, {n: control[i] for n, i in gathered.ids.items() if i in control})
    try:
        plan, alternatives = choose_plan(list(gathered.devices), ckpt, opts)
        plan = with_measured_paths(plan, gathered.devices, measured, session_manifest(ckpt, opts), opts, name)
        alternatives[opts.division] = plan.summary()  # /session's divisions show the plan as corrected
    except SessionError as exc:
        await drive.carry(core.refuse(str(exc), drive.now()))
        raise
    held.plan = plan
    await drive.carry(core.planned(plan, drive.now(), terms, alternatives))
    try:
        origins = core.origins.named(gathered.ids)  # as the plan message gave them
        ring = _host_ring(folder, gathered.ids, control, opts, terms, held, alternatives, nats, origins)
        server, serving = await drive.during(ring)
    except LinkError as exc:  # e.g. a member's wrong secret word: the members are told, not left
        await drive.carry(core.link_failed(f"the host could not link: {exc}", drive.now()))
        raise
    await drive.until(fm.Formed, core.started(drive.now()))
    role = held.ring()
    held.tasks.append(asyncio.ensure_future(drive.serve_formed(held.links, role.info.rendezvous)))
    reports = measured_reports(tuple(gathered.devices), measured)  # as the edges ran, for re-plans
    reports = after_plan(reports, plan)  # and with the shares and replicas the plan leaves on disk
    membership = Membership(1, plan, reports, frozenset(d.name for d in reports), name)
    plan_terms = PlanTerms(opts.context, opts.concurrency, opts.division, objective=opts.objective)
    manifest = ckpt.manifest(DTYPES[opts.dtype], opts.quant)  # as the plan was priced (choose_plan)
    epochs = HostEpochs(
        held, membership, manifest, plan_terms, gathered.ids, folder, server, opts, serving, role.traces,
        probed=tuple(gathered.devices), origins=core.origins,
    )  # fmt: skip
    epochs.start()  # a member lost from now on is planned around
    HostArrivals(epochs, drive, node)  # a member joining from now on is planned in, or kept as a spare
    held.serve_session_api()
    say_ready(plan)


def session_quant(requested: str, ckpt: Checkpoint) -> str:
    """The session's weight format: `requested` (--quant), or for "auto" the checkpoint's own."""
    try:
        return resolve_quant(requested, ckpt.stored_format)
    except StageError as exc:
        raise SessionError(str(exc)) from None


async def _host_ring(
    folder: Path,
    ids: dict[str, int],
    control: dict[int, Link],
    opts: Options,
    terms: SessionTerms,
    held: MemberRuntime,
    alternatives: dict[str, Any],
    nats: dict[str, tuple[str, str | None]],
    origins: dict[str, int],
) -> tuple[WeightServer, Serving]:
    """The host's links (its `control` links with every member, formed as they were admitted, are
    its ring edges too), weight serving and ring role (a step the formation core waits on)."""
    name, plan, node, code = held.name, held.plan, held.node, held.code
    assert plan is not None and node is not None and code is not None  # set before the plan was sent
    links = held.links = await link_ring(node, plan, name, ids, name, control)
    server = WeightServer(folder, cache=opts.cache)
    sharing = held.weights = Sharing(opts.cache, opts.weights_from, opts.replica_bytes)
    sharing.attach(links)  # members ask this host for ranges after forming too (replicas, re-plans)
    controls = [LinkChannel(link, peer) for peer, link in links.items()]
    if controls:
        say(f"serving weights to {len(controls)} member(s)")

    async def serve(channel: LinkChannel) -> None:
        if (error := (await server.serve(channel)).error) is not None:  # the host says why it will leave
            say(f"{channel.peer} could not take its weights: {error}")

    # serving starts while the checkpoint is described: a member asking meanwhile hears the hashing's progress
    serves = [asyncio.ensure_future(serve(c)) for c in controls]
    try:
        await sharing.host_folder(server)
        await asyncio.gather(*serves)
    finally:
        for task in serves:
            task.cancel()
    digest = await off_loop(checkpoint_id, folder)
    own = {"source": "own files", "path": str(folder), "fetched_bytes": 0, "fetched_tensor_bytes": 0}
    serving = Serving(terms, digest, alternatives, own, nats)
    with_api = held.api is not None
    held.role, held.app = await start_role(
        name, code, plan, folder, links, opts, serving, with_api, 1, origins
    )
    return (
        server,
        serving,
    )  # the server serves again when a re-plan moves blocks (kafila.session.forming.epochs)
