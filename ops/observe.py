"""`kafila-ops fleet traces|bench` and `kafila-ops monitor`: what the members measured, from afar."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from ops.fleetcmds import coordinator, member_traces, say, session_doc
from ops.fleetfile import FleetFile, api_key
from ops.remote import OpsError, Remote, Tunnel

BENCH_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


# The series `fleet traces` backfills, in base units (seconds, bytes), by name: what each one means.
# Every sample is one request (and stage, or hop) of a run, stamped with the collection time; labels
# `fleet`, `collected_from` (the member whose /traces held the record), `session`, `request`, and
# `member` (requests: the member whose API took the request; stages: the stage's member), `stage`
# (ring position, 0 = the head) or `hop` ("src->dst") and `path` (direct or relay).
BACKFILL: dict[str, str] = {
    "kafila_trace_request_queue_seconds": "time one request waited in the queue before its prefill",
    "kafila_trace_request_prefill_seconds": "one request's prompt through the ring until its first token",
    "kafila_trace_request_ttft_seconds": "time to first token of one request: queue plus prefill",
    "kafila_trace_request_decode_seconds": "one request's first token to its last",
    "kafila_trace_request_decode_tokens_per_second": "decode tokens per second of one request",
    "kafila_trace_request_prompt_tokens": "prompt tokens of one request",
    "kafila_trace_request_generation_tokens": "tokens one request generated",
    "kafila_trace_request_circuit_seconds": "median time around the ring per decode step of one request",
    "kafila_trace_request_transit_seconds": (
        "median circuit less every stage's compute per decode step of one request: hops and waits"
    ),
    "kafila_trace_stage_decode_seconds": "median compute per decode step of one request at one stage",
    "kafila_trace_stage_predicted_seconds": "the plan's predicted compute per decode step at one stage",
    "kafila_trace_stage_prefill_seconds": "compute of all of one request's prefill chunks at one stage",
    "kafila_trace_stage_wait_seconds": (
        "median wait per decode step of one request at one stage: frame arrived to its batch started"
    ),
    "kafila_trace_hop_bytes": "bytes a stage sent to the next member for one request, counted on the link",
    "kafila_trace_hop_rtt_seconds": "the link's smoothed round trip when one request ended (QUIC links)",
    "kafila_trace_hop_predicted_rtt_seconds": "the round trip the plan priced for the edge",
}


def openmetrics(fleet: FleetFile, records: dict[str, list[dict[str, Any]]], at: float) -> str:
    """The trace records as OpenMetrics gauges (BACKFILL), every sample stamped `at` (the collection
    time: the records carry no clock of their own), one series per request (and stage, or hop)."""
    from kafila.obs.trace import RequestRecord, StageRecord
    from kafila.obs.tracefile import from_json

    families: dict[str, list[str]] = {name: [] for name in BACKFILL}

    def sample(name: str, labels: dict[str, str], value: float | None) -> None:
        if value is None:
            return
        text = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
        families[name].append(f"{name}{{{text}}} {value:.6g} {at:.3f}")

    for member, recs in records.items():
        for d in recs:
            r = from_json(d)
            base = {"fleet": fleet.name, "collected_from": member, "session": r.session}
            if isinstance(r, RequestRecord):
                labels = base | {"member": r.member, "request": str(r.request_id), "epoch": str(r.epoch)}
                sample("kafila_trace_request_queue_seconds", labels, r.queue_s)
                sample("kafila_trace_request_prefill_seconds", labels, r.prefill_s)
                sample("kafila_trace_request_ttft_seconds", labels, r.ttft_s)
                sample("kafila_trace_request_decode_seconds", labels, r.decode_s)
                sample("kafila_trace_request_decode_tokens_per_second", labels, r.tokens_per_s)
                sample("kafila_trace_request_prompt_tokens", labels, r.prompt_tokens)
                sample("kafila_trace_request_generation_tokens", labels, r.completion_tokens)
                sample("kafila_trace_request_circuit_seconds", labels, r.circuit_ms / 1000)
                sample("kafila_trace_request_transit_seconds", labels, r.transit_ms / 1000)
            elif isinstance(r, StageRecord):
                of_request = {"request": str(r.request_id), "epoch": str(r.epoch)}
                labels = base | {"member": r.member, "stage": str(r.index)} | of_request
                sample("kafila_trace_stage_decode_seconds", labels, r.decode_ms / 1000)
                sample("kafila_trace_stage_predicted_seconds", labels, r.predicted_ms / 1000)
                sample("kafila_trace_stage_prefill_seconds", labels, sum(r.prefill_ms) / 1000)
                sample("kafila_trace_stage_wait_seconds", labels, r.wait_ms / 1000)
                if r.hop_out is not None:  # each hop once in the fleet: its sender's record
                    h = r.hop_out
                    hop = base | {"hop": h.name, "path": h.path} | of_request
                    sample("kafila_trace_hop_bytes", hop, h.bytes)
                    sample("kafila_trace_hop_rtt_seconds", hop, _seconds(h.rtt_ms))
                    sample("kafila_trace_hop_predicted_rtt_seconds", hop, _seconds(h.predicted_rtt_ms))
    out = []
    for name, lines in families.items():
        out += [f"# HELP {name} {BACKFILL[name]}", f"# TYPE {name} gauge", *sorted(set(lines))]
    return "\n".join([*out, "# EOF", ""])


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def traces(remote: Remote, fleet: FleetFile, out: Path) -> Path:
    """Every member's /traces as DIR/MEMBER.jsonl, then Prometheus TSDB blocks in DIR/tsdb."""
    out.mkdir(parents=True, exist_ok=True)
    records: dict[str, list[dict[str, Any]]] = {}
    for h in fleet.hosts:
        records[h.device] = member_traces(remote, fleet, h)
        (out / f"{h.device}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[h.device]))
        say(remote, f"{h.device}: {len(records[h.device])} trace records")
    om = out / "traces.om.txt"
    om.write_text(openmetrics(fleet, records, time.time()))
    promtool = shutil.which("promtool")
    if promtool is None:
        raise OpsError(
            "this machine: promtool is not installed (apt-get install --no-install-recommends prometheus)"
        )
    tsdb = out / "tsdb"
    done = subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(tsdb)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise OpsError(
            f"this machine: promtool tsdb create-blocks-from openmetrics: {done.stderr.strip()[-800:]}"
        )
    say(
        remote,
        f"TSDB blocks in {tsdb} (start a Prometheus with --storage.tsdb.path={tsdb}, or copy them into one)",
    )
    return tsdb


async def _users(
    base: str, model: str, users: int, requests: int, max_tokens: int, key: str | None
) -> list[float]:
    async def one(client: httpx.AsyncClient) -> float:
        started = time.perf_counter()
        r = await client.post(
            f"{base}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": BENCH_PROMPT}],
                  "max_tokens": max_tokens, "temperature": 0},
        )  # fmt: skip
        if r.status_code != 200:
            raise OpsError(f"the head's API answered {r.status_code}: {r.text[:300]}")
        return time.perf_counter() - started

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=600, headers=headers) as client:
        times: list[float] = []
        for _ in range(requests):
            times += await asyncio.gather(*(one(client) for _ in range(users)))
        return times


def bench(remote: Remote, fleet: FleetFile, out: Path, requests: int = 4, max_tokens: int = 32) -> str:
    """The paper's Table IV through the head's API: one user, then four at once."""
    from kafila.obs.trace import format_table, summarize
    from kafila.obs.tracefile import from_json

    found = coordinator(remote, fleet)  # the session host, or the member it handed its role over to
    doc = found[1] if found is not None else session_doc(remote, fleet, fleet.hosts[0]) or {}
    if doc.get("state") != "serving":
        why = f": {doc['error']}" if doc.get("error") else ""  # e.g. the API refused the key
        raise OpsError(
            f"fleet {fleet.name}: the session is not serving (state {doc.get('state', 'unknown')}){why}"
        )
    head = fleet.host(doc["head"])  # the ring's head keeps the request records (Table IV)
    # the name the session serves: a [fleet] weights folder's own, not [session] model's preset name
    model = str(doc.get("model") or fleet.plan.model)
    tunnel = Tunnel(remote, head, head.local_api)
    parts = [
        f"fleet {fleet.name}: Table IV through {head.device}'s API ({requests} rounds, {max_tokens} tokens)"
    ]
    try:
        base = f"http://127.0.0.1:{tunnel.port}"
        seen = {json.dumps(r, sort_keys=True) for r in member_traces(remote, fleet, head)}
        for users in (1, 4):
            say(remote, f"bench: {users} user(s), {requests} round(s)")
            asyncio.run(_users(base, model, users, requests, max_tokens, api_key(head)))
            now = member_traces(remote, fleet, head)
            fresh = [r for r in now if json.dumps(r, sort_keys=True) not in seen]
            seen |= {json.dumps(r, sort_keys=True) for r in fresh}
            table = summarize((from_json(r) for r in fresh), drop_cold=users == 1)
            parts.append(f"\n{users} user{'s' if users > 1 else ''}:\n{format_table(table)}")
    finally:
        tunnel.close()
    text = "\n".join(parts)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    say(remote, f"kept in {out}")
    return text


def monitor(
    remote: Remote, fleet: FleetFile, targets: Path, once: bool = False, listen: str = "127.0.0.1"
) -> None:
    """SSH tunnels to every member's metrics listener, listening on `listen` of this machine, and a
    Prometheus file_sd file naming them at that address with their site and host; re-opens a tunnel
    whose ssh exited."""
    tunnels: dict[str, Tunnel] = {}

    def write() -> None:
        groups = [
            {"targets": [f"{address_literal(listen)}:{t.port}"],
             "labels": {"fleet": fleet.name, "site": t.host.site, "host": t.host.ssh,
                        "member": t.host.device}}
            for t in tunnels.values()
        ]  # fmt: skip
        tmp = targets.with_name(targets.name + ".tmp")  # not matched by the file_sd globs
        tmp.write_text(json.dumps(groups, indent=2) + "\n")
        tmp.replace(targets)  # Prometheus sees the whole file or the old one

    targets.parent.mkdir(parents=True, exist_ok=True)
    try:
        while True:
            changed = False
            for h in fleet.hosts:
                t = tunnels.get(h.device)
                if t is None or t.proc.poll() is not None:
                    port = t.port if t else None
                    try:
                        tunnels[h.device] = Tunnel(
                            remote, h, f"{h.local_api.rsplit(':', 1)[0]}:{h.metrics_port}", port, listen
                        )
                        changed = True
                    except OpsError as exc:
                        say(remote, str(exc))
            if changed:
                write()
                say(remote, f"{len(tunnels)} target(s) in {targets}")
            if once:
                return
            time.sleep(5)
    finally:
        if not once:
            for t in tunnels.values():
                t.close()


def address_literal(address: str) -> str:
    """An address as a target's host part: IPv6 in brackets."""
    return f"[{address}]" if ":" in address else address


def default_targets(fleet: FleetFile) -> Path:
    """Where prometheus/prometheus.yml's file_sd reads (targets/*.json), from the repository root."""
    return Path("prometheus") / "targets" / f"{fleet.name}.json"


def bridge_address(interface: str = "docker0") -> str:
    """The IPv4 address of Docker's bridge on this machine: a tunnel listening there is reached by a
    container's Prometheus (the compose `monitoring` profile) through its gateway, and by nothing
    beyond this machine."""
    try:
        out = subprocess.run(
            ["ip", "-j", "-4", "addr", "show", "dev", interface], capture_output=True, text=True, timeout=10
        )
        addresses = [a["local"] for link in json.loads(out.stdout or "[]") for a in link.get("addr_info", [])]
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raise OpsError(f"monitor: cannot read {interface}'s address: {exc}") from None
    if not addresses:
        raise OpsError(
            f"monitor: no IPv4 address on {interface} (is Docker running here?); "
            "give --listen an address the compose Prometheus reaches"
        )
    return str(addresses[0])
