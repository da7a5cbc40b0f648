"""host and join: the two ways into a session (see kafila.session.form for the steps)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kafila.models.checkpoint import Checkpoint
from kafila.net.link import Link
from kafila.net.signaling import SignalingClient
from kafila.obs import metrics
from kafila.obs.log import get_logger
from kafila.obs.trace import TraceLog
from kafila.planner.devices import DeviceReport
from kafila.planner.plan import Plan
from kafila.proto.codes import SessionCode, new_code, parse_code
from kafila.session.channel import Heartbeat, LinkChannel
from kafila.session.form import (
    Formed,
    Options,
    SessionError,
    connect_node,
    default_name,
    fmt_plans,
    link_ring,
    next_session_message,
    payload,
    probe_report,
    say,
    session_record,
)

log = get_logger("kafila.session")


class Held:
    """What a member holds while its session forms, released if forming fails."""

    def __init__(self) -> None:
        self.client: SignalingClient | None = None
        self.node: Any = None
        self.tasks: list[asyncio.Task[Any]] = []
        self.links: dict[str, Link] = {}

    async def release(self) -> None:
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


async def host(opts: Options, on_code: Callable[[SessionCode], None] | None = None) -> Formed:
    held = Held()
    try:
        return await _host(opts, on_code, held)
    except BaseException:
        await asyncio.shield(held.release())
        raise


async def join(code_text: str, opts: Options) -> Formed:
    held = Held()
    try:
        return await _join(code_text, opts, held)
    except BaseException:
        await asyncio.shield(held.release())
        raise


async def _host(opts: Options, on_code: Callable[[SessionCode], None] | None, held: Held) -> Formed:
    from kafila.models.registry import resolve
    from kafila.session.weights import WeightServer

    folder = resolve(opts.model)
    ckpt = Checkpoint.open(folder)
    name = opts.name or default_name()
    client = held.client = await SignalingClient.connect(opts.rendezvous)
    config = ckpt.config.raw if len(json.dumps(ckpt.config.raw)) < 12_000 else None
    opened = await client.open_session(opts.model, opts.members, name, {"role": "host", "config": config})
    code = new_code(opened.session)
    say(f"session code: {code}   (members join with: kafila join {code})")
    if on_code:
        on_code(code)
    node = held.node = await connect_node(client, code, opts.rendezvous)
    pump = asyncio.ensure_future(node.signals.pump())
    held.tasks.append(pump)
    me = await asyncio.to_thread(probe_report, name, node, opts, config)
    devices, ids = await _gather_reports(node, me, opts)
    try:
        plan, alternatives = _plan(devices, ckpt, opts)
    except SessionError as exc:
        for peer in ids.values():
            if peer != node.member:
                await client.signal(peer, payload("refused", reason=str(exc)))
        raise
    for peer in ids.values():
        if peer != node.member:
            body = payload("plan", plan=plan.to_dict(), ids=ids, model=opts.model, chunk=opts.chunk)
            await client.signal(peer, body | {"alternatives": alternatives})
    links = held.links = await link_ring(node, plan, name, ids, name)
    server = WeightServer(folder, cache=opts.cache)
    controls = [LinkChannel(link, peer) for peer, link in links.items()]
    say(f"serving weights to {len(controls)} member(s)")
    await asyncio.gather(*(server.serve(c) for c in controls))
    formed = await _start_ring(
        name, code, plan, folder, links, node, client, opts, opts.model, opts.chunk, alternatives
    )
    formed.tasks.append(pump)
    await _wait_ready(node, len(ids) - 1, opts.wait_s)
    say(f"session ready: {len(plan.order)} members, head {plan.head}, ring {' -> '.join(plan.order)}")
    return formed


async def _gather_reports(
    node: Any, me: DeviceReport, opts: Options
) -> tuple[list[DeviceReport], dict[str, int]]:
    devices, ids = [me], {me.name: node.member}
    say(f"waiting for {opts.members - 1} member(s) (up to {opts.wait_s:.0f} s)")
    while len(devices) < opts.members:
        try:
            sender, msg = await next_session_message(node.signals, opts.wait_s)
        except TimeoutError:
            raise SessionError(
                f"only {len(devices)} of {opts.members} members arrived within {opts.wait_s:.0f} s "
                f"(joined: {', '.join(ids)}); ask the others to run `kafila join` with the code"
            ) from None
        if msg.get("op") == "report":
            device = DeviceReport.from_dict(msg["device"])
            if device.name in ids:
                device = DeviceReport.from_dict({**msg["device"], "name": f"{device.name}-{sender}"})
            devices.append(device)
            ids[device.name] = sender
            say(f"{device.name} joined ({len(devices)}/{opts.members})")
    return devices, ids


def _plan(devices: list[DeviceReport], ckpt: Checkpoint, opts: Options) -> tuple[Plan, dict[str, Any]]:
    from kafila.planner.decide import plan_all

    manifest = ckpt.manifest("F32" if opts.dtype in ("auto", "fp32") else None)
    plans = plan_all(devices, manifest, context=opts.context, concurrency=opts.concurrency, anchor=0)
    say("plans for this session (predicted):\n" + fmt_plans(plans))
    plan = plans[opts.division]
    if not plan.feasible:
        raise SessionError(f"the session cannot be formed with the {opts.division} division: {plan.reason}")
    return plan, {name: p.summary() for name, p in plans.items()}


async def _wait_ready(node: Any, n: int, timeout: float) -> None:
    ready = 0
    while ready < n:
        try:
            _, msg = await next_session_message(node.signals, timeout)
        except TimeoutError:
            raise SessionError(f"only {ready} of {n} members became ready within {timeout:.0f} s") from None
        ready += msg.get("op") == "ready"


async def _join(code_text: str, opts: Options, held: Held) -> Formed:
    from kafila.session.weights import fetch_shard

    code = parse_code(code_text)
    client = held.client = await SignalingClient.connect(opts.rendezvous)
    joined = await client.join(code.public, opts.name or default_name(), {"role": "member"})
    host_info = next(m for m in joined.members if m.host)
    name = f"{opts.name or default_name()}-{joined.member}" if opts.name is None else opts.name
    say(f"joined session {code.public} for model {joined.model} ({len(joined.members)} member(s) so far)")
    node = held.node = await connect_node(client, code, opts.rendezvous)
    pump = asyncio.ensure_future(node.signals.pump())
    held.tasks.append(pump)
    config = host_info.capability.get("config")  # the model's shape, for the block probe
    me = await asyncio.to_thread(probe_report, name, node, opts, config if isinstance(config, dict) else None)
    await client.signal(host_info.id, payload("report", device=me.to_dict()))
    say("waiting for the host's plan")
    _, msg = await next_session_message(node.signals, opts.wait_s)
    if msg.get("op") == "refused":
        raise SessionError(f"the host refused the session: {msg.get('reason')}")
    plan, ids = Plan.from_dict(msg["plan"]), {k: int(v) for k, v in msg["ids"].items()}
    me_name = next(k for k, v in ids.items() if v == node.member)
    host_name = next(k for k, v in ids.items() if v == host_info.id)
    links = held.links = await link_ring(node, plan, me_name, ids, host_name)
    a, b = plan.block_range(me_name)
    head = plan.head == me_name
    local = None if opts.use_local else []
    channel = LinkChannel(links[host_name], host_name)
    shard = await fetch_shard(channel, range(a, b), head, cache=opts.cache, local=local, label=me_name)
    say(
        f"weights: {shard.tensor_bytes / 1e6:.1f} MB fetched for blocks [{a}, {b}){' + head' if head else ''}"
    )
    formed = await _start_ring(
        me_name,
        code,
        plan,
        shard.path,
        links,
        node,
        client,
        opts,
        msg["model"],
        msg["chunk"],
        msg.get("alternatives"),
    )
    formed.tasks.append(pump)
    formed.shard = shard  # type: ignore[attr-defined]
    await client.signal(host_info.id, payload("ready"))
    return formed


async def _start_ring(
    name: str,
    code: SessionCode,
    plan: Plan,
    folder: Path,
    links: dict[str, Link],
    node: Any,
    client: SignalingClient,
    opts: Options,
    model: str,
    chunk: int,
    alternatives: dict[str, Any] | None = None,
) -> Formed:
    from kafila.engine.stage import Stage
    from kafila.engine.tokenizer import Tokenizer
    from kafila.session.compute import ModelThread
    from kafila.session.head import RingHead, RingInfo
    from kafila.session.member import RingMember

    ckpt = Checkpoint.open(folder)
    tokenizer = Tokenizer.from_checkpoint(ckpt)
    a, b = plan.block_range(name)
    index, order = plan.order.index(name), list(plan.order)
    head = plan.head == name
    stage = await asyncio.to_thread(
        Stage.load, ckpt, range(a, b), head, opts.backend, opts.dtype, plan.context, plan.concurrency
    )
    nxt_name, prv_name = order[(index + 1) % len(order)], order[index - 1]
    edges = {f"{e.src}->{e.dst}": ("direct" if e.direct else "relay") for e in plan.edges}
    if nxt_name in links:
        edges[f"{name}->{nxt_name}"] = str(links[nxt_name].path)
    info = RingInfo(
        session=code.public,
        model=model,
        division=plan.division,
        order=tuple(order),
        blocks={s.name: (s.start, s.stop) for s in plan.stages},
        predicted_ms={s.name: (s.cost_s or 0.0) * 1e3 for s in plan.stages},
        edges=edges,
        plan={"chosen": plan.summary(), "divisions": alternatives or {}},
    )
    nxt = _channel(links.get(nxt_name), nxt_name, opts)
    prv = _channel(links.get(prv_name), prv_name, opts) if len(order) > 2 or nxt is None else nxt
    traces = TraceLog(opts.trace) if opts.trace else None
    model_thread = ModelThread(name)
    if head:
        service: Any = RingHead(
            stage, model_thread, info, nxt, prv, tuple(tokenizer.stop_ids), plan.concurrency, chunk, traces
        )
        record = session_record(plan, code.public, model, edges)
        if traces:
            traces.write(record)
        metrics.observe_session(record)
    else:
        service = RingMember(index, stage, model_thread, info, nxt, prv)  # type: ignore[arg-type]
    service.start()
    api = await _serve_api(service, tokenizer, model, traces, opts) if opts.api else None
    return Formed(name, code, plan, service, api, client, node, links)


def _channel(link: Link | None, peer: str, opts: Options) -> Heartbeat | None:
    return Heartbeat(LinkChannel(link, peer), opts.dead_after).start() if link is not None else None


async def _serve_api(service: Any, tokenizer: Any, model: str, traces: TraceLog | None, opts: Options) -> Any:
    from kafila.api.app import create_app
    from kafila.api.server import ApiServer, parse_addr
    from kafila.api.state import Api
    from kafila.session.textcodec import TokenizerCodec

    codec = TokenizerCodec(tokenizer)
    host, port = parse_addr(opts.api or "")
    server = await ApiServer(create_app(Api(service, codec, model, traces)), host, port).start()
    say(f"API at {server.url} (OpenAI {server.url}/v1, Ollama {server.url}/api, {server.url}/session)")
    return server
