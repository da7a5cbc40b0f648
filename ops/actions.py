"""What `kafila-ops` runs on each host, as values: no I/O here.

Every remote command is one shell string built with `shlex` (the remote side's sh parses it once),
wrapped into a system `ssh` argv with batch mode and connection sharing. `up_steps` is the ordered
list `fleet up` runs (and `fleet plan` prints); the session code is a placeholder until the host
member printed it.
"""

from __future__ import annotations

import hashlib
import plistlib
import shlex
from dataclasses import dataclass
from pathlib import Path

from ops.fleetfile import FleetFile, Host

CODE_PLACEHOLDER = "<CODE>"
CONTAINER_CODE_FILE = "/tmp/kafila-session-code"  # inside the host member's container: fresh each run
LABEL_FLEET = "dev.kafila.fleet"
LABEL_MEMBER = "dev.kafila.member"
CACHE_VOLUME = "kafila-cache"
# A member's API keys on its host: one folder per fleet in the ssh user's 0700 folder (a shell word:
# $HOME expands remotely); inside a member's container, the file bind-mounted read-only.
KEY_DIR = "~/.config/kafila-ops"
CONTAINER_KEY_FILE = "/run/kafila/api-key"
RELAY_STATE = "/var/lib/kafila"  # the rendezvous image's state folder (Dockerfile.rendezvous)


@dataclass(frozen=True)
class Step:
    """One remote command of a fleet action: where, what for, and the shell string."""

    host: Host
    what: str  # "check docker", "start member a100", ...
    remote: str  # the shell command run on host.ssh

    def describe(self) -> str:
        return f"[{self.host.site}/{self.host.device} {self.host.ssh}] {self.what}: {self.remote}"


def ssh_options(control_dir: Path | None, config: str | None = None, target: str = "") -> list[str]:
    """The system ssh, never asking (BatchMode), sharing one connection per host (ControlMaster);
    `control_dir` None: a connection of its own (tunnels, which must end with their process).

    The shared connection is named for the destination as written (and the ssh config): ssh's own
    %C hashes the resolved address, user and port, which several config aliases can share (jump
    hosts and ProxyCommands: the lab's hosts are all 127.0.0.1:22 behind their own ProxyCommand),
    and one alias's commands would then run on another's machine."""
    argv = ["ssh"]
    if config:
        argv += ["-F", config]
    argv += ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=15"]
    if control_dir is None:
        return [*argv, "-o", "ControlMaster=no", "-o", "ControlPath=none"]
    name = hashlib.sha256(f"{config or ''}\0{target}".encode()).hexdigest()[:24]  # short: socket paths
    shared = [
        "-o",
        "ControlMaster=auto",
        "-o",
        f"ControlPath={control_dir}/{name}",
        "-o",
        "ControlPersist=120",
    ]
    return [*argv, *shared]


def ssh_argv(target: str, remote: str, control_dir: Path, config: str | None = None) -> list[str]:
    return [*ssh_options(control_dir, config, target), "--", target, remote]


def unit(fleet: FleetFile, host: Host) -> str:
    """The container, systemd unit or launchd label of a member: kafila-FLEET-MEMBER."""
    return f"kafila-{fleet.name}-{host.device}"


def launchd_label(fleet: FleetFile, host: Host) -> str:
    return f"dev.kafila.{fleet.name}.{host.device}"


def key_file(fleet: FleetFile, host: Host) -> str:
    """Where `up` puts the member's API keys on its host (`~/` is the remote user's home)."""
    return f"{KEY_DIR}/{fleet.name}/{host.device}.api-key"


def member_key_file(fleet: FleetFile, host: Host) -> str:
    """The key file as the member sees it: in its container, or on its host."""
    return CONTAINER_KEY_FILE if host.runtime == "docker" else key_file(fleet, host)


def ship_key(fleet: FleetFile, host: Host) -> Step:
    """Write the key file (on the remote's standard input, never in a command line) with umask 077 in
    a 0700 folder; 0600 for a native member. A container's user (another uid) reads it through a
    read-only bind mount, which checks only the file's own mode: 0644 there, still unreachable for
    the host's other users behind the 0700 folders."""
    path = word(key_file(fleet, host))
    folder = word(f"{KEY_DIR}/{fleet.name}")
    mode = "644" if host.runtime == "docker" else "600"
    remote = (
        f"umask 077 && mkdir -p {folder} && chmod 700 {word(KEY_DIR)} {folder}"
        f" && cat > {path}.tmp && chmod {mode} {path}.tmp && mv -f {path}.tmp {path}"
    )
    return Step(host, f"ship the API key file (mode {mode})", remote)


def member_args(fleet: FleetFile, host: Host, code: str, code_file: str) -> list[str]:
    """`kafila host ...` for the session host, `kafila join CODE ...` for every other member."""
    common = ["--name", host.device, "--rendezvous", fleet.rendezvous.url, "--api", host.api]
    if host.metrics is not None:  # a listener of its own, up while forming or broken
        common += ["--metrics", host.metrics]
    if host.api_key_file is not None:
        common += ["--api-key-file", member_key_file(fleet, host)]
    if host.device == fleet.session_host:
        p = fleet.plan
        return [
            "host", "--model", p.model, "--members", str(len(fleet.hosts)), "--context", str(p.context),
            "--concurrency", str(p.concurrency), "--code-file", code_file, *common, *host.args,
        ]  # fmt: skip
    return ["join", code, *common, *host.args]


def code_file(host: Host) -> str:
    """Where the host member writes the session code (a shell word: $HOME expands remotely)."""
    return CONTAINER_CODE_FILE if host.runtime == "docker" else '"$HOME"/.cache/kafila-ops/session-code'


def word(a: str) -> str:
    """One shell word, quoted; a leading ~/ (or "$HOME"/) still means the remote user's home."""
    if a.startswith('"$HOME"/'):
        return a
    if a.startswith("~/"):
        return '"$HOME"/' + shlex.quote(a[2:])
    return shlex.quote(a)


def _words(argv: list[str]) -> str:
    return " ".join(word(a) for a in argv)


def docker_run(fleet: FleetFile, host: Host, image: str, args: list[str]) -> str:
    name = unit(fleet, host)
    argv = [
        "docker", "run", "-d", "--name", name,
        "--label", f"{LABEL_FLEET}={fleet.name}", "--label", f"{LABEL_MEMBER}={host.device}",
        "--network", "host",  # published ports would hide the member's NAT from its classification
        "-v", f"{CACHE_VOLUME}:/var/cache/kafila",
        "-e", f"KAFILA_HEALTH_ADDR={host.local_api}", "-e", "KAFILA_LOG=json",
    ]  # fmt: skip
    if host.gpus != "none":
        argv += ["--gpus", host.gpus]
    mount = ""
    if host.api_key_file is not None:  # one word whose ~/ the remote shell expands
        mount = f" -v {word(f'{key_file(fleet, host)}:{CONTAINER_KEY_FILE}:ro')}"
    remove_old = f"docker rm -f {shlex.quote(name)} >/dev/null 2>&1;"
    return f"{remove_old} {shlex.join(argv)}{mount} {shlex.join([image, *args])}"


def native_start(fleet: FleetFile, host: Host, args: list[str]) -> str:
    """A native member through the host's service manager (never a backgrounded shell); the session
    host's old code file goes first, so that `up` never reads a previous session's code."""
    kafila = [host.python, "-m", "kafila", *args]
    fresh = 'mkdir -p "$HOME"/.cache/kafila-ops'
    if host.device == fleet.session_host:
        fresh += ' && rm -f "$HOME"/.cache/kafila-ops/session-code'

    if host.os == "linux":
        name = unit(fleet, host)
        stop = f"systemctl --user stop {shlex.quote(name)}.service >/dev/null 2>&1;"
        reset = f"systemctl --user reset-failed {shlex.quote(name)}.service >/dev/null 2>&1;"
        run = [
            "systemd-run", "--user", "--unit", name, "--collect", "--property", "Restart=no",
            "--setenv", "KAFILA_LOG=json", "--setenv", "PYTHONUNBUFFERED=1",
            "--description", f"kafila member {host.device} of fleet {fleet.name}",
        ]  # fmt: skip
        return f"{stop} {reset} {fresh} && {shlex.join(run)} {_words(kafila)}"
    label = launchd_label(fleet, host)
    log = f'"$HOME"/Library/Logs/kafila/{shlex.quote(fleet.name + "-" + host.device)}.log'
    script = f"exec {_words(kafila)} >>{log} 2>&1"
    plist = plistlib.dumps(
        {
            "Label": label,
            "ProgramArguments": ["/bin/sh", "-c", script],
            "RunAtLoad": True,
            "KeepAlive": False,
            "EnvironmentVariables": {"KAFILA_LOG": "json", "PYTHONUNBUFFERED": "1"},
        }
    ).decode()
    path = f'"$HOME"/Library/LaunchAgents/{shlex.quote(label)}.plist'
    return (
        f'mkdir -p "$HOME"/Library/LaunchAgents "$HOME"/Library/Logs/kafila && {fresh}'
        f" && launchctl bootout gui/$(id -u)/{shlex.quote(label)} >/dev/null 2>&1;"
        f" printf %s {shlex.quote(plist)} > {path} && launchctl bootstrap gui/$(id -u) {path}"
    )


def start(fleet: FleetFile, host: Host, image: str, code: str) -> Step:
    args = member_args(fleet, host, code, code_file(host))
    role = "start the session host member" if host.device == fleet.session_host else "start joining member"
    if host.runtime == "docker":
        return Step(host, f"{role} {host.device} (container)", docker_run(fleet, host, image, args))
    return Step(host, f"{role} {host.device} (native service)", native_start(fleet, host, args))


def python_in(fleet: FleetFile, host: Host, code: str) -> str:
    """Run a Python snippet where the member runs: inside its container, or its interpreter."""
    if host.runtime == "docker":
        return shlex.join(["docker", "exec", unit(fleet, host), "python", "-c", code])
    return _words([host.python, "-c", code])


def fetch(fleet: FleetFile, host: Host, path: str, address: str | None = None) -> str:
    """Print GET http://ADDRESS/PATH as seen from the member's machine (its API is on loopback), with
    the first key of the member's key file where its API asks for one (read there: the key is never
    in a command line)."""
    url = f"http://{address or host.local_api}{path}"
    keys = member_key_file(fleet, host) if host.api_key_file is not None and address is None else None
    snippet = (
        "import os, sys, urllib.request, urllib.error\n"
        f"q = urllib.request.Request({url!r})\n"
        f"k = {keys!r}\n"
        "if k:\n"
        "    lines = (s for line in open(os.path.expanduser(k)) if (s := line.strip()))\n"
        "    q.add_header('Authorization', 'Bearer ' + next(s for s in lines if not s.startswith('#')))\n"
        "try: r = urllib.request.urlopen(q, timeout=5); sys.stdout.write(r.read().decode())\n"
        "except urllib.error.HTTPError as e: sys.stdout.write(e.read().decode())"
    )
    return python_in(fleet, host, snippet)


def read_code(fleet: FleetFile, host: Host) -> Step:
    if host.runtime == "docker":
        remote = shlex.join(["docker", "exec", unit(fleet, host), "cat", CONTAINER_CODE_FILE])
    else:
        remote = 'cat "$HOME"/.cache/kafila-ops/session-code'
    return Step(host, "read the session code", remote)


def checks(fleet: FleetFile, host: Host, image: str) -> list[Step]:
    if host.runtime == "docker":
        steps = [Step(host, "check Docker", "docker version --format '{{.Server.Version}}'")]
        if host.gpus != "none":
            steps.append(Step(host, "check the NVIDIA runtime", "docker info --format '{{json .Runtimes}}'"))
        steps.append(
            Step(
                host,
                f"check image {image}",
                shlex.join(["docker", "image", "inspect", "--format", "{{.Id}}", image]),
            )
        )
        return steps
    manager = "systemd-run" if host.os == "linux" else "launchctl"
    return [
        Step(host, f"check {manager}", f"command -v {manager}"),
        Step(host, f"check kafila in {host.python}", _words([host.python, "-c", "import kafila"])),
    ]


def load_image() -> str:
    return "docker load"


def rendezvous_start(fleet: FleetFile) -> Step | None:
    r = fleet.rendezvous
    if r.host is None:
        return None
    args = [
        "rendezvous", "--host", "0.0.0.0", "--port", str(r.port), "--udp-port", str(r.udp_port),
        "--udp-alt-port", str(r.udp_alt_port),
    ]  # fmt: skip
    if r.alt_address:  # two public addresses: NAT filtering is classified (RFC 5780's other address)
        args += ["--udp-host", r.address, "--udp-alt-host", r.alt_address]
    h = r.host
    if h.runtime == "docker":
        name, volume = unit(fleet, h), relay_volume(fleet)
        args += ["--relay-secret-file", f"{RELAY_STATE}/relay.key"]
        argv = [
            "docker", "run", "-d", "--name", name, "--label", f"{LABEL_FLEET}={fleet.name}",
            "--label", f"{LABEL_MEMBER}=rendezvous", "--network", "host", "--entrypoint", "kafila",
            "-e", "KAFILA_LOG=json", "-v", f"{volume}:{RELAY_STATE}", r.image, *args,
        ]  # fmt: skip
        create = ["docker", "volume", "create", "--label", f"{LABEL_FLEET}={fleet.name}", volume]
        return Step(
            h,
            "start the rendezvous (container)",
            f"docker rm -f {shlex.quote(name)} >/dev/null 2>&1; {shlex.join(create)} >/dev/null"
            f" && {shlex.join(argv)}",
        )
    args += ["--relay-secret-file", f"{KEY_DIR}/{fleet.name}/rendezvous-relay.key"]
    return Step(h, "start the rendezvous (native service)", native_start(fleet, h, args))


def relay_volume(fleet: FleetFile) -> str:
    """The rendezvous container's volume for its kept secret (`--relay-secret-file`): a restarted
    rendezvous takes the fleet's running session and relay channels back; `down` removes it."""
    return f"kafila-{fleet.name}-rendezvous"


def images_for(fleet: FleetFile, host: Host) -> str:
    return fleet.rendezvous.image if host.device == "rendezvous" else fleet.image


def docker_hosts(fleet: FleetFile) -> list[Host]:
    r = fleet.rendezvous.host
    return [h for h in ([r] if r else []) + list(fleet.hosts) if h.runtime == "docker"]


def up_steps(fleet: FleetFile, code: str = CODE_PLACEHOLDER) -> list[Step]:
    """Every command `fleet up` runs, in order (image shipping, which only happens where the image is
    missing, is listed as the `docker load` its `docker save` feeds)."""
    everyone = ([fleet.rendezvous.host] if fleet.rendezvous.host else []) + list(fleet.hosts)
    steps = [s for h in everyone for s in checks(fleet, h, images_for(fleet, h))]
    steps += [
        Step(h, f"ship image {images_for(fleet, h)} if missing (docker save | ssh)", load_image())
        for h in docker_hosts(fleet)
    ]
    steps += [ship_key(fleet, h) for h in fleet.hosts if h.api_key_file is not None]
    rdv = rendezvous_start(fleet)
    if rdv is not None:
        steps += [rdv, Step(rdv.host, "wait until the rendezvous answers", rendezvous_health(fleet))]
    head = fleet.hosts[0]
    steps += [start(fleet, head, fleet.image, code), read_code(fleet, head)]
    steps += [start(fleet, h, fleet.image, code) for h in fleet.joiners]
    steps.append(Step(head, "wait until the session serves", fetch(fleet, head, "/session")))
    return steps


def rendezvous_health(fleet: FleetFile) -> str:
    h = fleet.rendezvous.host
    assert h is not None
    return fetch(fleet, h, "/healthz", f"127.0.0.1:{fleet.rendezvous.port}")


def stop(fleet: FleetFile, host: Host) -> Step:
    """Remove what `up` started on the host, and the fleet's key files there; idempotent (nothing
    there is not an error)."""
    keys = f" rm -rf {word(f'{KEY_DIR}/{fleet.name}')}; rmdir {word(KEY_DIR)} >/dev/null 2>&1;"
    if host.runtime == "docker":
        label = shlex.quote(f"label={LABEL_FLEET}={fleet.name}")
        remote = (
            f"ids=$(docker ps -aq --filter {label});"
            f' [ -z "$ids" ] || docker rm -f $ids >/dev/null;{keys}'
            f" vols=$(docker volume ls -q --filter {label});"
            f' [ -z "$vols" ] || docker volume rm $vols >/dev/null; echo removed $ids $vols'
        )
        return Step(host, "remove the fleet's containers", remote)
    if host.os == "linux":
        name = shlex.quote(unit(fleet, host) + ".service")
        remote = (
            f"systemctl --user stop {name} >/dev/null 2>&1;"
            f" systemctl --user reset-failed {name} >/dev/null 2>&1;"
            f' rm -f "$HOME"/.cache/kafila-ops/session-code;{keys} echo stopped'
        )
        return Step(host, f"stop service {unit(fleet, host)}", remote)
    label = shlex.quote(launchd_label(fleet, host))
    remote = (
        f"launchctl bootout gui/$(id -u)/{label} >/dev/null 2>&1;"
        f' rm -f "$HOME"/Library/LaunchAgents/{label}.plist "$HOME"/.cache/kafila-ops/session-code;'
        f"{keys} echo stopped"
    )
    return Step(host, f"stop launchd agent {launchd_label(fleet, host)}", remote)


def down_steps(fleet: FleetFile) -> list[Step]:
    """Joiners first, then the host member, then the rendezvous: once per docker host (by label)."""
    steps: list[Step] = []
    seen: set[str] = set()
    everyone = [*reversed(fleet.hosts), *([fleet.rendezvous.host] if fleet.rendezvous.host else [])]
    for h in everyone:
        if h.runtime == "docker":
            if h.ssh in seen:
                continue
            seen.add(h.ssh)
        steps.append(stop(fleet, h))
    return steps


def logs(fleet: FleetFile, host: Host, lines: int = 50) -> Step:
    n = str(lines)
    if host.runtime == "docker":
        return Step(host, "logs", shlex.join(["docker", "logs", "--tail", n, unit(fleet, host)]) + " 2>&1")
    if host.os == "linux":
        return Step(
            host,
            "logs",
            shlex.join(["journalctl", "--user", "-u", unit(fleet, host) + ".service", "-n", n, "--no-pager"]),
        )
    path = f'"$HOME"/Library/Logs/kafila/{shlex.quote(fleet.name + "-" + host.device)}.log'
    return Step(host, "logs", f"tail -n {n} {path}")


def state(fleet: FleetFile, host: Host) -> Step:
    """The container's or service's state, one word."""
    if host.runtime == "docker":
        remote = (
            shlex.join(["docker", "inspect", "--format", "{{.State.Status}}", unit(fleet, host)])
            + " 2>/dev/null || echo absent"
        )
        return Step(host, "container state", remote)
    if host.os == "linux":
        return Step(
            host,
            "service state",
            shlex.join(["systemctl", "--user", "is-active", unit(fleet, host) + ".service"]) + " || true",
        )
    label = shlex.quote(launchd_label(fleet, host))
    return Step(
        host,
        "agent state",
        f"launchctl print gui/$(id -u)/{label} 2>/dev/null | sed -n 's/^[[:space:]]*state = //p' | head -n1",
    )
