"""`kafila-ops fleet up` on a fleet that serves: a rolling upgrade, member by member (the order is
ops.rolling's, a pure function; this is the ssh side that reads the fleet and carries it out)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from typing import Any

from kafila.proto.speaks import Build, BuildError
from ops import actions
from ops.fleetcmds import coordinator, host_named, last_lines, say, session_doc, ship_images, wait_for
from ops.fleetfile import FleetFile, Host
from ops.remote import OpsError, Remote, local_image_id
from ops.rolling import Member, Replace, Rollout, plan_rollout

BUILD_INFO = re.compile(r'^kafila_build_info\{[^}]*\bversion="([^"]+)"', re.M)


def serving(remote: Remote, fleet: FleetFile) -> dict[str, Any] | None:
    """The /session document of the member that coordinates the session (the session host, or the
    member it handed its role over to) where the session serves."""
    found = coordinator(remote, fleet)
    return None if found is None else found[1]


def host_of(fleet: FleetFile, doc: dict[str, Any]) -> Host:
    head = host_named(fleet, doc)
    if head is None:
        raise OpsError(
            f"fleet {fleet.name}: the session's host {doc.get('host')!r} is none of the fleet's members"
        )
    return head


def build_from(text: str, where: str) -> Build:
    try:
        return Build.from_dict(json.loads(text.strip().splitlines()[-1]))
    except (ValueError, IndexError, BuildError) as exc:
        raise OpsError(
            f"{where}: no wire versions read ({exc}); a kafila older than kafila.proto.speaks cannot say "
            f"which versions it speaks: replace it with `fleet down` and `fleet up`; it printed "
            f"{text[-300:]!r}"
        ) from None


def local_build(image: str) -> Build:
    """The wire versions of a local image's kafila (asked of the image on this machine)."""
    argv = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python", image]
    done = subprocess.run([*argv, "-m", "kafila.proto.speaks"], capture_output=True, text=True, timeout=300)
    return build_from(done.stdout or done.stderr, f"this machine: image {image}")


def running_version(remote: Remote, fleet: FleetFile, host: Host) -> str:
    """The kafila version the member's process runs (its kafila_build_info, read from its API)."""
    step = actions.Step(host, "read the member's kafila version", actions.fetch(fleet, host, "/metrics"))
    text = remote.run(step, timeout=60)
    m = BUILD_INFO.search(text)
    if m is None:
        raise OpsError(f"{remote.where(step)}: no kafila_build_info in its /metrics: {text[:200]!r}")
    return m.group(1)


def session_build(remote: Remote, fleet: FleetFile, head: Host) -> Build:
    """What the session's host (`head`) runs: its container's build, or a native host's
    interpreter's where that is the version its process runs."""
    if head.runtime == "docker":
        step = actions.speaks(fleet, head, installed=False)
        return build_from(remote.run(step, timeout=60), remote.where(step))
    step = actions.speaks(fleet, head, installed=True)
    disk = build_from(remote.run(step, timeout=60), remote.where(step))
    runs = running_version(remote, fleet, head)
    if runs != disk.kafila:
        raise OpsError(
            f"{remote.where(step)}: the session host runs kafila {runs} and its interpreter now has "
            f"{disk.kafila}: which wire versions the running host speaks cannot be read"
        )
    return disk


def read_members(remote: Remote, fleet: FleetFile) -> list[Member]:
    """What each member runs and what the fleet names now, with the new builds' wire versions."""
    members: list[Member] = []
    images: dict[str, tuple[str, Build | None]] = {}
    for h in fleet.hosts:
        if h.runtime == "docker":
            image = actions.images_for(fleet, h)
            if image not in images:
                images[image] = (local_image_id(image), None)
            wanted, build = images[image]
            running = remote.run(actions.image_of(fleet, h), timeout=60).strip()
            if running != wanted and build is None:
                build = local_build(image)
                images[image] = (wanted, build)
            members.append(Member(h.device, h.site, h.runtime, running, wanted, build))
            continue
        step = actions.speaks(fleet, h, installed=True)
        new = build_from(remote.run(step, timeout=60), remote.where(step))
        members.append(
            Member(h.device, h.site, h.runtime, running_version(remote, fleet, h), new.kafila, new)
        )
    return members


def serves_without(fleet: FleetFile, names: list[str]) -> dict[str, str | None]:
    """Per member: None when the planner finds a feasible plan over the fleet's other devices."""
    from kafila.models.presets import resolve_model
    from kafila.planner import plan_all

    p = fleet.plan
    _config, manifest = resolve_model(p.model, "bf16")
    out: dict[str, str | None] = {}
    for name in names:
        rest = [d for d in p.devices if d.name != name]
        if not rest:
            out[name] = "it is the only member"
            continue
        plans = plan_all(rest, manifest, context=p.context, concurrency=p.concurrency)
        feasible = any(plan.feasible for plan in plans.values())
        out[name] = None if feasible else next(iter(plans.values())).reason or "no feasible plan"
    return out


def rollout(remote: Remote, fleet: FleetFile, doc: dict[str, Any]) -> Rollout:
    """`doc`: the /session document of the member that coordinates (a build that hands its role
    over names it, `host`)."""
    members = read_members(remote, fleet)
    ring = [str(n) for n in doc.get("ring", [])]
    without = serves_without(fleet, [m.device for m in members if m.changes])
    head = host_of(fleet, doc)
    succession = [str(n) for n in doc.get("succession", [])]
    build = session_build(remote, fleet, head)
    return plan_rollout(members, head.device, ring, build, without, succession, hands_over="host" in doc)


def session_code(remote: Remote, fleet: FleetFile, head: Host) -> str:
    """The session's code, from the member that keeps it: the session host member, which keeps it
    after it handed its role over and joined again (`head`, the one that coordinates, first)."""
    for h in [head, *(h for h in fleet.hosts if h is not head)]:
        done = remote.call(actions.read_code(fleet, h), timeout=60)
        if done.rc == 0 and done.out.strip():
            return done.out.strip()
    raise OpsError(
        f"fleet {fleet.name}: no member keeps the session code (read on {head.device} and the others)"
    )


def roll(remote: Remote, fleet: FleetFile, doc: dict[str, Any], wait_s: float, dry_run: bool) -> Rollout:
    """Replace the members whose build differs, one at a time (see ops.rolling); an OpsError
    naming the host and step where one could not leave, start or join again."""
    say(remote, f"fleet {fleet.name}: the session {doc.get('session')} serves; planning a rolling upgrade")
    plan = rollout(remote, fleet, doc)
    print(f"fleet {fleet.name}: rolling upgrade, one member at a time:\n{plan.describe()}", flush=True)
    if plan.refused:
        raise OpsError(f"fleet {fleet.name}: rolling upgrade refused; nothing was stopped")
    if dry_run or not plan.steps:
        return plan
    hosts = {h.device: h for h in fleet.hosts}
    docker = [hosts[s.device] for s in plan.steps if s.runtime == "docker"]
    image_ids = {actions.images_for(fleet, h): s.wanted for s in plan.steps for h in [hosts[s.device]]}
    ship_images(remote, fleet, docker, image_ids)
    head = host_of(fleet, doc)
    code = session_code(remote, fleet, head)
    for i, step in enumerate(plan.steps, 1):
        started = time.monotonic()
        if step.hand_over is not None:
            head = hand_over_one(remote, fleet, hosts[step.device], step, code, wait_s)
        else:
            replace_one(remote, fleet, hosts[step.device], step, code, wait_s, head)
        say(remote, f"{i}/{len(plan.steps)}: {step.device} serves again on {step.wanted[:19]} "
                    f"after {time.monotonic() - started:.1f} s")  # fmt: skip
    print(f"fleet {fleet.name}: rolling upgrade done: {', '.join(s.device for s in plan.steps)} replaced")
    return plan


def replace_one(
    remote: Remote, fleet: FleetFile, host: Host, step: Replace, code: str, wait_s: float, head: Host
) -> None:
    """`host` leaves, the session serves without it, it starts on the new build, and the session
    serves with it again (in the ring or as a spare); `head` coordinates the session."""
    say(remote, f"{host.device} ({host.ssh}, site {host.site}): leaving the session")
    remote.run(actions.leave(fleet, host), timeout=actions.LEAVE_S + 60)

    def without() -> dict[str, Any] | None:
        doc = session_doc(remote, fleet, head)
        if doc is None or doc.get("state") != "serving":
            return None
        return None if host.device in [*doc.get("ring", ()), *doc.get("spares", ())] else doc

    wait_for(
        remote, fleet, head, f"wait until the session serves without {host.device}", wait_s, without, (head,)
    )
    rejoin(remote, fleet, host, step, code, wait_s, head)


def rejoin(
    remote: Remote, fleet: FleetFile, host: Host, step: Replace, code: str, wait_s: float, head: Host
) -> None:
    """`host` starts on the new build and joins with `code`; the session serves with it again (in
    the ring or as a spare), as `head`, which coordinates, says."""
    say(remote, f"{host.device}: starting on the new build and joining again")
    image = step.wanted if host.runtime == "docker" else ""
    remote.run(actions.start(fleet, host, image, code, join=True))
    if host.device == fleet.session_host:  # it keeps the code for the next rolling upgrade
        remote.run(actions.keep_code(fleet, host), stdin=f"{code}\n")

    def back() -> dict[str, Any] | None:
        doc = session_doc(remote, fleet, head)
        if doc is None or doc.get("state") != "serving":
            return None
        return doc if host.device in [*doc.get("ring", ()), *doc.get("spares", ())] else None

    what = f"wait until {host.device} serves again"
    try:
        wait_for(remote, fleet, head, what, wait_s, back, (head, host))
    except OpsError as exc:
        raise OpsError(f"{exc}\n-- {host.device} ({host.ssh}):\n{last_lines(remote, fleet, host)}") from None


def hand_over_one(
    remote: Remote, fleet: FleetFile, host: Host, step: Replace, code: str, wait_s: float
) -> Host:
    """The member that coordinates (`host`) hands its role over and ends; its successor serves
    the session without it; it starts on the new build and joins again with the session's code.
    Returns the member that coordinates from now on."""
    now = session_doc(remote, fleet, host) or {}  # its order as it is now: members came back since
    names = [*now.get("succession", ()), *(step.hand_over or ()), *(h.device for h in fleet.hosts)]
    order = [h for name in dict.fromkeys(names) for h in fleet.hosts if h.device == name and h is not host]
    say(remote, f"{host.device} ({host.ssh}, site {host.site}): handing the session's host role over")
    remote.run(actions.hand_over(fleet, host), timeout=actions.HAND_OVER_S + 60)

    def successor() -> tuple[Host, dict[str, Any]] | None:
        for h in order:  # the first of its succession order that serves without it
            doc = session_doc(remote, fleet, h)
            if doc is None or doc.get("state") != "serving" or doc.get("host") != h.device:
                continue
            return None if host.device in [*doc.get("ring", ()), *doc.get("spares", ())] else (h, doc)
        return None

    what = f"wait until a member of {', '.join(h.device for h in order)} serves the session as its host"
    head, _doc = wait_for(remote, fleet, order[0], what, wait_s, successor)
    say(remote, f"{head.device} coordinates the session now")
    rejoin(remote, fleet, host, step, code, wait_s, head)
    return head
