"""`kafila-ops fleet up|down|status|logs`: the fleet's containers and services over ssh."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ops import actions
from ops.fleetfile import FleetFile, Host, api_key
from ops.registry import LocalRegistry, pull_through_tunnel, registry_binary
from ops.remote import OpsError, Remote, local_image_id, ship_image

POLL_S = 2.0


def say(remote: Remote, text: str) -> None:
    print(f"kafila-ops: {text}", file=remote.out, flush=True)


def everyone(fleet: FleetFile) -> list[Host]:
    return ([fleet.rendezvous.host] if fleet.rendezvous.host else []) + list(fleet.hosts)


def check_hosts(remote: Remote, fleet: FleetFile, image_ids: dict[str, str]) -> list[Host]:
    """Every host reachable with what its runtime needs, and the session host's [fleet] weights where
    the fleet names them; returns the docker hosts lacking their image."""
    if fleet.weights_url is not None:
        check_mirror(remote, fleet)
    lacking: list[Host] = []
    for h in everyone(fleet):
        image = actions.images_for(fleet, h)
        for step in actions.checks(fleet, h, image):
            if step.what.startswith("check image"):
                have = remote.run(step, check=False).strip()
                if have != image_ids[image]:
                    lacking.append(h)
                continue
            out = remote.run(step)
            if step.what.startswith(("check kafila", "check the model weights")):
                say(remote, f"{h.device} ({h.ssh}, site {h.site}): {out.strip()}")
            if step.what == "check the NVIDIA runtime" and "nvidia" not in out:
                raise OpsError(
                    f"{remote.where(step)}: no GPU runtime: docker info lists runtimes {out.strip()} without "
                    'nvidia (install nvidia-container-toolkit, or set gpus = "none" for this host)'
                )
    return lacking


def check_mirror(remote: Remote, fleet: FleetFile) -> None:
    """[fleet] weights as a mirror URL answers every checkpoint file, asked from this machine
    before anything starts (the session host fetches the model from it)."""
    import asyncio

    from kafila.session.weights.mirror import mirror_lacks

    url = fleet.weights_url
    assert url is not None
    lacking = asyncio.run(mirror_lacks(url))
    if lacking:
        raise OpsError(
            f"[fleet] weights {url}: the mirror does not answer {', '.join(lacking)}, which the session "
            f"host {fleet.session_host} would fetch {fleet.plan.model} from (asked from this machine; a "
            "private hub repository needs HF_TOKEN here and on the session host)"
        )
    say(remote, f"[fleet] weights {url}: answers config.json and every safetensors file")


def ship_keys(remote: Remote, fleet: FleetFile) -> None:
    """Every member's API key file to its host, through ssh's standard input."""
    for h in fleet.hosts:
        if h.api_key_file is None:
            continue
        api_key(h)  # readable and valid, else a FleetError naming the host
        step = actions.ship_key(fleet, h)
        remote.run(step, stdin=Path(h.api_key_file).read_text(encoding="utf-8"))
        say(remote, f"{h.device}: API key file in {actions.key_file(fleet, h)} on {h.ssh}")


def last_lines(remote: Remote, fleet: FleetFile, host: Host, n: int = 15) -> str:
    try:
        return remote.run(actions.logs(fleet, host, n), timeout=30, check=False).strip()
    except OpsError as exc:
        return f"(no logs: {exc})"


def session_doc(remote: Remote, fleet: FleetFile, host: Host) -> dict[str, Any] | None:
    try:
        text = remote.run(
            actions.Step(host, "read /session", actions.fetch(fleet, host, "/session")),
            timeout=30,
            check=False,
        )
        doc = json.loads(text)
    except (OpsError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def host_named(fleet: FleetFile, doc: dict[str, Any]) -> Host | None:
    """The fleet's member a serving /session document names as the one that coordinates the
    session (`host`: the session host, or the member it handed its role over to); a build whose
    documents name none: the session host."""
    name = doc.get("host", fleet.session_host)
    return next((h for h in fleet.hosts if h.device == name), None)


def coordinator(remote: Remote, fleet: FleetFile) -> tuple[Host, dict[str, Any]] | None:
    """The member that coordinates the serving session and its /session document, found through
    the first running member that serves (the session host first); None where none serves."""
    for h in fleet.hosts:
        state, _ = member_state(remote, fleet, h)
        doc = session_doc(remote, fleet, h) if state == actions.RUNNING else None
        if doc is None or doc.get("state") != "serving":
            continue
        named = host_named(fleet, doc)
        if named is None or named is h:
            return (h, doc) if named is h else None
        theirs = session_doc(remote, fleet, named)
        return (named, theirs) if theirs is not None and theirs.get("state") == "serving" else None
    return None


def member_state(remote: Remote, fleet: FleetFile, host: Host) -> tuple[str, str]:
    """The member's process state (actions.member_state's words) and what the host printed."""
    step = actions.state(fleet, host)
    try:
        done = remote.call(step, timeout=30)
    except OpsError as exc:  # ssh logged in to nothing that answers within the time
        return actions.UNREACHABLE, str(exc)
    detail = (done.err if done.rc == 255 else done.out).strip()
    return actions.member_state(host, done.rc, done.out), detail.splitlines()[-1] if detail else ""


def wait_for(
    remote: Remote,
    fleet: FleetFile,
    host: Host,
    what: str,
    timeout: float,
    probe: Any,
    watch: tuple[Host, ...] = (),
) -> Any:
    """Poll `probe` until it returns something; a watched member whose container or service ended,
    or whose host cannot be reached or has no Docker running, fails at once (with its last log lines
    where its host answers)."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        for h in watch:
            state, detail = member_state(remote, fleet, h)
            where = f"host {h.device} ({h.ssh}, site {h.site}): {what}"
            if state in actions.HOST_FAILED:
                raise OpsError(f"{where}: {state}: {detail}")
            if state in actions.GONE:
                raise OpsError(
                    f"{where}: the member's "
                    f"{'container' if h.runtime == 'docker' else 'service'} is {state}; its last log lines:\n"
                    f"{last_lines(remote, fleet, h)}"
                )
        if time.monotonic() > deadline:
            raise OpsError(
                f"host {host.device} ({host.ssh}, site {host.site}): {what}: not within {timeout:.0f} s; "
                f"its last log lines:\n{last_lines(remote, fleet, host)}"
            )
        time.sleep(POLL_S)


def up(remote: Remote, fleet: FleetFile, wait_s: float = 900.0) -> dict[str, Any]:
    """Bring the fleet up; returns the head's /session document and timings."""
    started = time.monotonic()
    images = {actions.images_for(fleet, h) for h in actions.docker_hosts(fleet)}
    image_ids = {image: local_image_id(image) for image in images}
    say(remote, f"fleet {fleet.name}: checking {len(everyone(fleet))} host(s) over ssh")
    lacking = check_hosts(remote, fleet, image_ids)
    transfer_s = ship_images(remote, fleet, lacking, image_ids)
    ship_keys(remote, fleet)
    rdv = actions.rendezvous_start(fleet)
    if rdv is not None:
        say(remote, f"starting the rendezvous on {rdv.host.ssh}")
        remote.run(rdv)
        health = actions.Step(rdv.host, "wait until the rendezvous answers", actions.rendezvous_health(fleet))
        wait_for(
            remote,
            fleet,
            rdv.host,
            health.what,
            60,
            lambda: '"ok"' in remote.run(health, check=False),
            (rdv.host,),
        )
    head = fleet.hosts[0]
    say(remote, f"starting the session host {head.device} on {head.ssh}")
    remote.run(actions.start(fleet, head, image_ids.get(fleet.image, fleet.image), ""))
    read = actions.read_code(fleet, head)
    code = wait_for(
        remote,
        fleet,
        head,
        "read the session code",
        wait_s,
        lambda: remote.run(read, check=False).strip(),
        (head,),
    )
    say(remote, f"session code {code}")
    for h in fleet.joiners:
        say(remote, f"starting member {h.device} on {h.ssh} ({h.runtime})")
        remote.run(actions.start(fleet, h, image_ids.get(fleet.image, fleet.image), code))
    n = len(fleet.hosts)

    def serving() -> dict[str, Any] | None:
        doc = session_doc(remote, fleet, head)
        if doc and doc.get("state") == "broken":
            raise OpsError(
                f"host {head.device} ({head.ssh}, site {head.site}): wait until the session serves: "
                f"the session broke while forming: {doc.get('error')}"
            )
        return doc if doc and doc.get("state") == "serving" and len(doc.get("ring", ())) == n else None

    try:
        what = f"wait until the session serves ({n} members)"
        doc = wait_for(remote, fleet, head, what, wait_s, serving, fleet.hosts)
    except OpsError as exc:
        late = [
            h
            for h in fleet.joiners
            if (d := session_doc(remote, fleet, h)) is None or d.get("state") != "serving"
        ]
        tails = "\n".join(f"-- {h.device} ({h.ssh}):\n{last_lines(remote, fleet, h)}" for h in late)
        raise OpsError(f"{exc}\nmembers not serving: {[h.device for h in late]}\n{tails}") from None
    took = time.monotonic() - started
    print(describe_plan(fleet, doc))
    print(f"fleet {fleet.name} serving after {took:.1f} s (image transfer {transfer_s:.1f} s)")
    return {"session": doc, "up_s": took, "transfer_s": transfer_s, "code": code}


def describe_plan(fleet: FleetFile, doc: dict[str, Any]) -> str:
    lines = [
        f"session {doc.get('session')} model {doc.get('model')} division {doc.get('division')},"
        f" head {doc.get('head')}"
    ]
    lines.append(f"{'member':<14} {'site':<14} {'blocks':<10} {'predicted ms':>12}  API (on its host)")
    for m in doc.get("members", []):
        h = fleet.host(m["name"])
        a, b = m["blocks"]
        pred = m.get("predicted_ms")
        lines.append(
            f"{m['name']:<14} {h.site:<14} {f'{a}-{b}':<10} {pred if pred is None else f'{pred:.2f}':>12}  http://{h.api}/v1"
        )
    for link in doc.get("links", []):
        lines.append(f"link {link['edge']}: {link['path']}")
    return "\n".join(lines)


def down(remote: Remote, fleet: FleetFile) -> None:
    """Every host's removal, each whatever the others did; says what each removed, and raises an
    OpsError naming every host, site and step that could not (a later `down` finishes the job)."""
    failed: list[str] = []
    found = coordinator(remote, fleet)  # it goes last of the members (the session ends with it)
    for step in actions.down_steps(fleet, found[0].device if found else None):
        where = remote.where(step)
        try:
            done = remote.call(step, timeout=60)
        except OpsError as exc:  # no answer in time: the next host still gets its turn
            say(remote, f"FAILED: {exc}")
            failed.append(str(exc))
            continue
        removed = " ".join(done.out.split()) if done.rc != 255 else ""
        if done.rc == 0:
            say(remote, f"{where}: {removed or 'done'}")
            continue
        why = Remote.why(done.rc, done.err or done.out)
        say(
            remote, f"{where}: FAILED: {why}" + (f" (removed before it failed: {removed})" if removed else "")
        )
        failed.append(f"{where}: {why.splitlines()[0]}")
    if failed:
        raise OpsError(
            f"fleet {fleet.name}: down could not finish on {len(failed)} host(s); run down again once "
            "they answer:\n  " + "\n  ".join(failed)
        )
    say(remote, f"fleet {fleet.name}: down finished on every host")


def status(remote: Remote, fleet: FleetFile) -> dict[str, Any]:
    """Each member's container or service state and its /session view; prints a table."""
    rows: dict[str, Any] = {}
    for h in everyone(fleet):
        state, detail = member_state(remote, fleet, h)
        reachable = state not in actions.HOST_FAILED
        doc = session_doc(remote, fleet, h) if h.device != "rendezvous" and reachable else None
        rows[h.device] = {
            "site": h.site, "ssh": h.ssh, "runtime": h.runtime, "state": state, "detail": detail,
            "session": doc,
        }  # fmt: skip
    any_doc = next((r["session"] for r in rows.values() if r["session"]), None) or {}
    measured = measured_ms(remote, fleet, any_doc)
    print(
        f"{'member':<14} {'site':<14} {'runtime':<8} {'process':<18} {'session':<10} {'blocks':<8}"
        f" {'predicted ms':>12} {'measured ms':>11}"
    )
    for name, r in rows.items():
        doc = r["session"] or {}
        me: dict[str, Any] = next((m for m in doc.get("members", []) if m["name"] == name), {})
        blocks = "-".join(map(str, me.get("blocks", []))) or "-"
        pred = me.get("predicted_ms")
        print(
            f"{name:<14} {r['site']:<14} {r['runtime']:<8} {r['state']:<18} {doc.get('state', '-'):<10}"
            f" {blocks:<8} "
            f"{'-' if pred is None else f'{pred:.2f}':>12} {_ms(measured.get(name)):>11}"
        )
    docs = [r["session"] for r in rows.values() if r["session"] and r["session"].get("state") == "serving"]
    named = {c.device for d in docs if (c := host_named(fleet, d)) is not None}
    coordinates = next((n for n in rows if n in named), fleet.session_host)
    if coordinates != fleet.session_host:
        print(
            f"the session's host is {coordinates} (the fleet's session host {fleet.session_host} handed its "
            "role over)"
        )
    for link in (rows.get(coordinates, {}).get("session") or {}).get("links", []):
        print(f"link {link['edge']}: {link['path']}")
    hosts = {h.device: h for h in everyone(fleet)}
    for name, r in rows.items():
        if r["state"] != actions.RUNNING:
            step = actions.state(fleet, hosts[name])
            tail = (
                f": {r['detail']}" if r["state"] in actions.HOST_FAILED and r["detail"] != r["state"] else ""
            )
            say(remote, f"{remote.where(step)}: {r['state']}{tail}")
    return rows


STATUS_HOST_FAILED = 1  # a host could not be asked (unreachable, no Docker running, no answer)
STATUS_NOT_RUNNING = 3  # every host answered; a member's process is not running (as systemctl's 3)


def status_exit(rows: dict[str, Any]) -> int:
    """status's exit status: 0 when every member runs, else 1 or 3 (STATUS_*)."""
    states = [r["state"] for r in rows.values()]
    if any(s in actions.HOST_FAILED for s in states):
        return STATUS_HOST_FAILED
    return 0 if all(s == actions.RUNNING for s in states) else STATUS_NOT_RUNNING


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def member_traces(remote: Remote, fleet: FleetFile, host: Host) -> list[dict[str, Any]]:
    step = actions.Step(host, "collect /traces", actions.fetch(fleet, host, "/traces"))
    text = remote.run(step, timeout=60)
    try:
        records = json.loads(text)["traces"]
    except (ValueError, KeyError, TypeError) as exc:
        raise OpsError(f"{remote.where(step)}: not a /traces document: {text[:200]!r}") from exc
    return list(records)


def measured_ms(remote: Remote, fleet: FleetFile, doc: dict[str, Any]) -> dict[str, float]:
    """Each stage's measured ms per decode step (median over the head's recent requests); empty
    before any request was served."""
    from kafila.obs.tracefile import from_json

    head = doc.get("head")
    if not isinstance(head, str) or head not in [h.device for h in fleet.hosts]:
        return {}
    try:
        records = [from_json(r) for r in member_traces(remote, fleet, fleet.host(head))]
    except (OpsError, ValueError):
        return {}
    return epoch_stage_ms(records, doc)


def epoch_stage_ms(records: list[Any], doc: dict[str, Any]) -> dict[str, float]:
    """Each stage's median ms per decode step over the requests of the session's current plan epoch
    (`doc`'s): requests of earlier epochs passed other stages (a member left or joined since)."""
    from kafila.obs.trace import RequestRecord, summarize

    epoch = doc.get("epoch", 1)
    now = [r for r in records if not isinstance(r, RequestRecord) or r.epoch == epoch]
    ours = [s for s in summarize(now, drop_cold=False) if s.session == doc.get("session")]
    return dict(ours[-1].stage_ms) if ours else {}


def logs(remote: Remote, fleet: FleetFile, member: str | None, lines: int) -> None:
    """Each member's last log lines; an OpsError naming every host whose logs could not be read."""
    rdv = fleet.rendezvous.host
    if member == "rendezvous" and rdv is not None:
        hosts = [rdv]
    else:
        hosts = [fleet.host(member)] if member else everyone(fleet)
    failed: list[str] = []
    for h in hosts:
        print(f"== {h.device} ({h.ssh}, site {h.site})")
        step = actions.logs(fleet, h, lines)
        try:
            done = remote.call(step, timeout=60)
        except OpsError as exc:
            print(f"(no logs: {exc})")
            failed.append(str(exc))
            continue
        if done.rc == 0:
            print(done.out.rstrip())
            continue
        why = Remote.why(done.rc, done.err or done.out)
        print(f"(no logs: {why})")
        failed.append(f"{remote.where(step)}: {why.splitlines()[0]}")
    if failed:
        raise OpsError(f"fleet {fleet.name}: logs failed on {len(failed)} host(s):\n  " + "\n  ".join(failed))


def ship_images(remote: Remote, fleet: FleetFile, hosts: list[Host], image_ids: dict[str, str]) -> float:
    """Each host's image to it: layer by layer through a registry on this machine where one is
    installed (ops.registry: only the layers a host lacks cross), else whole (docker save | load).
    Returns the seconds it took."""
    if not hosts:
        return 0.0
    binary = registry_binary()
    if binary is None:
        say(
            remote,
            "no docker-registry on this machine (apt-get install docker-registry): images travel whole",
        )
        images = {h.device: actions.images_for(fleet, h) for h in hosts}
        return sum(ship_image(remote, h, images[h.device], image_ids[images[h.device]]) for h in hosts)
    started = time.monotonic()
    with LocalRegistry(binary, out=remote.out) as registry:
        for image in sorted({actions.images_for(fleet, h) for h in hosts}):
            say(remote, f"pushing {image} ({image_ids[image][:19]}) to this machine's registry")
            registry.push(image)
        for h in hosts:
            image = actions.images_for(fleet, h)
            say(remote, f"{h.device}: pulling {image} through an ssh tunnel (only the layers it lacks)")
            got = pull_through_tunnel(registry, fleet.ssh_config, h, image)
            sent = f"{got.layer_bytes / 1e6:.1f} MB ({got.total_bytes / 1e6:.1f} MB in all)"
            say(
                remote,
                f"{h.device}: {image} pulled: {got.layers} layer(s) sent, {sent} in {got.seconds:.1f} s",
            )
    return time.monotonic() - started
