"""Building a member's ring role from the plan, its links and its loaded stage.

The forming steps (kafila.session.forming) call `start_role` once every edge is linked and the
weights are here; what it returns is all the runtime (kafila.session.runtime) holds of the ring.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kafila.api.app import create_app
from kafila.api.state import Api, ModelFacts
from kafila.engine.draft import draft_model_of, policy_for
from kafila.engine.draft_model import DraftModel, load_draft_model
from kafila.engine.stage import Stage
from kafila.engine.tokenizer import Tokenizer
from kafila.models.checkpoint import Checkpoint
from kafila.net.link import Link, PathChange
from kafila.obs import metrics
from kafila.obs.trace import SessionRecord, TraceLog
from kafila.planner.plan import Plan
from kafila.proto.codes import SessionCode
from kafila.proto.ring import RingBroken
from kafila.proto.session import SessionTerms
from kafila.session.channel import Heartbeat, LinkChannel
from kafila.session.progress import note, off_loop, say
from kafila.session.ring.compute import ModelThread
from kafila.session.ring.head import RingHead
from kafila.session.ring.info import RingInfo
from kafila.session.ring.member import RingMember
from kafila.session.ring.origins import first_origins
from kafila.session.ring.schedule import lanes_for
from kafila.session.ring.stagetrace import planned_rtt_ms
from kafila.session.ring.textcodec import TokenizerCodec
from kafila.session.terms import Options

if TYPE_CHECKING:
    from starlette.applications import Starlette

RingRole = RingHead | RingMember  # what a member runs in the ring: the head, or any other member


def shard_text(a: int, b: int, head: bool) -> str:
    """A member's share for the person watching: "blocks [0, 9) + head"."""
    return f"blocks [{a}, {b})" + (" + head" if head else "")


@dataclass(frozen=True)
class Serving:
    """What the host decided for every member's ring role and API."""

    terms: SessionTerms  # model, chunk, queue, dtype, ...
    checkpoint: str  # the checkpoint id (its safetensors headers' digest): the Ollama digest
    alternatives: dict[str, Any] | None = None  # the divisions compared, for /session
    weights: dict[str, Any] | None = None  # where this member's shard came from, for /session
    nats: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # member -> NAT class, mapping


async def start_role(
    name: str,
    code: SessionCode,
    plan: Plan,
    folder: Path,
    links: dict[str, Link],
    opts: Options,
    serving: Serving,
    with_api: bool,
    epoch: int = 1,
    origins: Mapping[str, int] | None = None,
) -> tuple[RingRole, Starlette | None]:
    """Member `name`'s ring role for `plan` (plan epoch `epoch`: its channels carry that epoch's
    messages only), started on `links` with its stage loaded from `folder`, and (`with_api`) the
    session's API app over it, served once the session formed. `origins`: the host's request
    origin tag of every member (kafila.session.ring.origins; None: by first ring index)."""
    origins = first_origins(plan.order) if origins is None else origins
    if name not in origins:
        raise ValueError(f"the host gave member {name} no request origin (it gave {sorted(origins)})")
    model = serving.terms.model
    ckpt = Checkpoint.open(folder)  # a member's shard: its own tensors only
    tokenizer = Tokenizer.from_checkpoint(ckpt)
    a, b = plan.block_range(name)
    index = plan.order.index(name)
    head = plan.head == name
    parts = await epoch_parts(name, code, plan, ckpt, links, opts, serving, epoch)
    stage, info, nxt, prv = parts.stage, parts.info, parts.next, parts.prev
    traces = TraceLog(opts.trace)  # without a file: the last records for /traces only
    model_thread = ModelThread(name)
    role: RingRole
    if head:
        lanes = parts.lanes
        drafter = await head_drafter(opts.draft, stage)
        role = RingHead(
            stage,
            model_thread,
            info,
            nxt,
            prv,
            tuple(tokenizer.stop_ids),
            plan.concurrency,
            serving.terms.chunk,
            traces,
            lanes,
            serving.terms.queue,
            origins,
            draft=policy_for(opts.draft, opts.draft_ahead),
            drafter=drafter,
        )
        role.plan = plan  # /session prices it for the tokens per circuit the head measures
        traces.write(session_record(plan, code.public, model, info.edges, epoch))
    else:
        if nxt is None or prv is None:  # a plan puts a member that is not the head in a ring of 2+
            raise ValueError(f"member {name} has no ring neighbour in the plan {plan.order}")
        role = RingMember(index, stage, model_thread, info, nxt, prv, traces, origins[name])
        role.draft = policy_for(opts.draft, opts.draft_ahead)  # should the head move here
    metrics.observe_session(
        session_record(plan, code.public, model, info.planned), ring_view=head, epoch=epoch
    )
    metrics.observe_plan(epoch)
    for edge, by in info.measured_by.items():  # this member's own links, as they run now
        if edge in info.planned and info.edges[edge] in metrics.PATHS:
            metrics.observe_edge(edge, info.planned[edge], info.edges[edge], measured_by=by)
    role.epoch = epoch
    role.on_broken = lambda why: say(broken_line(name, why))
    role.start()
    if not with_api:  # the API's line is the others' "ready"
        say(f"serving {shard_text(a, b, head)}; no API on this member (--api off)")
        return role, None
    facts = ModelFacts.of(ckpt.config, stage.backend.wire_dtype, serving.checkpoint, serving.terms.quant)
    return role, create_app(Api(role, TokenizerCodec(tokenizer), model, facts, traces))


async def head_drafter(mode: str, stage: Stage) -> DraftModel | None:
    """The head's draft model where --draft names one (loaded off the event loop for `stage`'s
    context and slots), else None."""
    model = draft_model_of(mode)
    if model is None:
        return None
    note(f"loading the draft model {model} into memory")
    return await off_loop(load_draft_model, model, stage)


@dataclass(frozen=True)
class EpochParts:
    """What a member's role serves one plan epoch with: its stage, ring view and channels."""

    index: int
    stage: Stage
    info: RingInfo
    next: Heartbeat | None
    prev: Heartbeat | None
    lanes: int  # the head's decode lanes for this plan


async def epoch_parts(
    name: str,
    code: SessionCode,
    plan: Plan,
    ckpt: Checkpoint,
    links: dict[str, Link],
    opts: Options,
    serving: Serving,
    epoch: int = 1,
    held: tuple[Stage, ModelThread] | None = None,
) -> EpochParts:
    """Member `name`'s stage for `plan` loaded from `ckpt` (its shard), its view of the ring and
    its channels to its ring neighbours on `links` (beating from now on). `held`: the stage of
    the epoch before and the thread that owns it; the new stage takes the blocks (and head) it
    holds as they are in memory and reads only the others (Stage.rebuild, on that thread)."""
    a, b = plan.block_range(name)
    head = plan.head == name
    blocks, backend = range(a, b), opts.backend
    if held is None:
        note(f"loading {shard_text(a, b, head)} into memory")
        load = partial(Stage.load, pace=opts.pace, quant=serving.terms.quant)  # the session's format
        stage = await off_loop(load, ckpt, blocks, head, backend, opts.dtype, plan.context, plan.concurrency)
    else:
        old, thread = held
        kept = len(range(max(a, old.blocks.start), min(b, old.blocks.stop)))
        note(f"loading {shard_text(a, b, head)} into memory ({kept} blocks already held)")
        rebuild = partial(old.rebuild, pace=opts.pace, quant=serving.terms.quant)
        stage = await thread.run(rebuild, ckpt, blocks, head, plan.context, plan.concurrency)
    metrics.observe_build(stage.backend.name, stage.backend.dtype, stage.backend.device)
    nxt_name, prv_name = plan.successor(name), plan.predecessor(name)
    info = _ring_info(name, code, plan, links, serving, stage.backend.dtype, epoch)
    info.rendezvous.update(url=opts.rendezvous, state="connected")
    nxt = _channel(links.get(nxt_name), name, nxt_name, opts, epoch)
    prv = (
        _channel(links.get(prv_name), name, prv_name, opts, epoch)
        if len(plan.order) > 2 or nxt is None
        else nxt
    )
    lanes = lanes_for(plan.circuit_s, plan.bottleneck_s, len(plan.order))
    return EpochParts(plan.order.index(name), stage, info, nxt, prv, lanes)


def broken_line(name: str, broken: RingBroken) -> str:
    """What member `name` says at its console when its ring broke."""
    why = broken.text()
    # the others' view of this member, which heard their "broken" on waking (its own view of its
    # stall says so itself: kafila.session.ring.role, `_counted_lost`)
    if broken.blames(name) and not broken.detail.startswith(f"this member ({name})"):
        why += (
            ": that is this member, whose process did not run in time (stopped, asleep or swapping), "
            "so the others counted it gone"
        )
    # (a member lost is planned around, kafila.session.forming.epochs; this break is not one)
    return f"{why}. This member answers requests with 503 from now on: end it (Ctrl-C) and form a new session"


def _ring_info(
    name: str,
    code: SessionCode,
    plan: Plan,
    links: dict[str, Link],
    serving: Serving,
    dtype: str,
    epoch: int = 1,
) -> RingInfo:
    """What /session and the traces say of the ring, from member `name`'s side: its edges follow
    the path this member's own links are on now (ring and control), the others the plan's."""
    nxt_name, prv_name = plan.successor(name), plan.predecessor(name)
    planned = {f"{e.src}->{e.dst}": ("direct" if e.direct else "relay") for e in plan.edges}
    edges = dict(planned)
    own = {
        f"{src}->{dst}": links[peer]
        for src, dst, peer in ((name, nxt_name, nxt_name), (prv_name, name, prv_name))
        if peer in links
    }
    own |= {f"{name}<->{peer}": link for peer, link in links.items() if peer not in (nxt_name, prv_name)}
    follow_paths(edges, own, name, planned)
    return RingInfo(
        session=code.public,
        model=serving.terms.model,
        division=plan.division,
        order=tuple(plan.order),
        blocks={s.name: (s.start, s.stop) for s in plan.stages},
        predicted_ms={s.name: (s.cost_s or 0.0) * 1e3 for s in plan.stages},
        edges=edges,
        planned=planned,
        measured_by=dict.fromkeys(own, name),
        nat=dict(serving.nats),
        plan={"chosen": plan.summary(), "divisions": serving.alternatives or {}},
        edge_rtt_ms=planned_rtt_ms(plan.edges),
        dtype=dtype,
        quant=serving.terms.quant,
        weights=serving.weights or {},
        epoch=epoch,
    )


def follow_paths(
    edges: dict[str, str],
    links: dict[str, Link],
    measured_by: str | None = None,
    planned: dict[str, str] | None = None,
) -> None:
    """Keep `edges[key]` at the path `links[key]` is on ("direct" or "relay"), also after the link
    falls back to the relay or returns to its direct path, and "closed" once it is (what /session
    shows; a closed link kept showing its last path). With `measured_by` (the member whose links
    these are), a ring edge's change (one `planned` has) is exported as kafila_edge_info too."""
    for key, link in links.items():
        if link.path is not None:
            edges[key] = link.path.value
        plan_path = (planned or {}).get(key) if measured_by is not None else None
        link.on_path_change.append(partial(_set_path, edges, key, plan_path, measured_by))
        link.on_close.append(partial(edges.__setitem__, key, "closed"))


def _set_path(
    edges: dict[str, str], key: str, planned: str | None, measured_by: str | None, change: PathChange
) -> None:
    edges[key] = change.new.value
    if planned is not None and measured_by is not None:
        metrics.observe_edge(key, planned, change.new.value, measured_by=measured_by)


def _channel(link: Link | None, name: str, peer: str, opts: Options, epoch: int) -> Heartbeat | None:
    """Member `name`'s ring channel to `peer` on `link`: its frames to `peer` timed as hop name->peer."""
    if link is None:
        return None
    return Heartbeat(LinkChannel(link, peer, epoch, hop=f"{name}->{peer}"), opts.dead_after).start()


def session_record(
    plan: Plan, session: str, model: str, edges: dict[str, str], epoch: int = 1
) -> SessionRecord:
    return SessionRecord(
        session=session,
        model=model,
        division=plan.division,
        order=tuple(plan.order),
        head=plan.head or plan.order[0],
        blocks={s.name: (s.start, s.stop) for s in plan.stages},
        predicted_stage_ms={s.name: (s.cost_s or 0.0) * 1e3 for s in plan.stages},
        predicted_bottleneck_ms=(plan.bottleneck_s or 0.0) * 1e3,
        predicted_circuit_ms=(plan.circuit_s or 0.0) * 1e3,
        edges=edges,
        epoch=epoch,
    )
