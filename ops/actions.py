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
CACHE_DIR = "~/.cache/kafila-ops"  # native members' per-fleet state: CACHE_DIR/FLEET/session-code
CONTAINER_KEY_FILE = "/run/kafila/api-key"
# The session host's [fleet] weights folder (or GGUF file) inside its container (read-only): it keeps
# its own name under it, which the session serves the model as (kafila.models.registry.served_name).
CONTAINER_WEIGHTS = "/srv/kafila-weights"
# A member's Kafila cache in its container: the volume CACHE_VOLUME, the image's user's (converted
# models, a GGUF's in-place folder, fetched weights).
CONTAINER_CACHE = "/var/cache/kafila"
CONTAINER_UID = 10001  # the image's `kafila` user (Dockerfile.cuda), who reads the mounted weights
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


def member_args(fleet: FleetFile, host: Host, code: str, code_file: str, join: bool = False) -> list[str]:
    """`kafila host ...` for the session host, `kafila join CODE ...` for every other member and for
    the session host joining the serving session again (`join`: it handed its role over)."""
    common = ["--name", host.device, "--rendezvous", fleet.rendezvous.url, "--api", host.api]
    if host.metrics is not None:  # a listener of its own, up while forming or broken
        common += ["--metrics", host.metrics]
    if host.api_key_file is not None:
        common += ["--api-key-file", member_key_file(fleet, host)]
    if host.device == fleet.session_host and not join:
        p = fleet.plan
        return [
            "host", "--model", member_model(fleet, host), "--members", str(len(fleet.hosts)),
            "--context", str(p.context), "--concurrency", str(p.concurrency), "--code-file", code_file,
            *(["--weights-from", fleet.weights_url] if fleet.weights_url else []), *common, *host.args,
        ]  # fmt: skip
    return ["join", code, *common, *host.args]


def member_model(fleet: FleetFile, host: Host) -> str:
    """The session host's --model: [fleet] weights as the member sees the folder or GGUF file (in
    its container, or the path on its host), else [session] model (a default model's name)."""
    if fleet.weights is None or fleet.weights_url is not None:
        return fleet.plan.model
    if host.runtime == "docker":
        return f"{CONTAINER_WEIGHTS}/{fleet.weights.rsplit('/', 1)[-1]}"
    return fleet.weights


def state_dir(fleet: FleetFile) -> str:
    """A native member's per-fleet folder on its host (a shell word: $HOME expands remotely): two
    fleets sharing a host never read, replace or remove each other's session code."""
    return word(f"{CACHE_DIR}/{fleet.name}")


def code_file(fleet: FleetFile, host: Host) -> str:
    """Where the host member writes the session code (a shell word: $HOME expands remotely)."""
    return CONTAINER_CODE_FILE if host.runtime == "docker" else f"{state_dir(fleet)}/session-code"


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
        "-v", f"{CACHE_VOLUME}:{CONTAINER_CACHE}", "-e", f"KAFILA_CACHE={CONTAINER_CACHE}",
        "-e", f"KAFILA_HEALTH_ADDR={host.local_api}", "-e", "KAFILA_LOG=json",
    ]  # fmt: skip
    if host.gpus != "none":
        argv += ["--gpus", host.gpus]
    mount = ""
    if host.api_key_file is not None:  # one word whose ~/ the remote shell expands
        mount = f" -v {word(f'{key_file(fleet, host)}:{CONTAINER_KEY_FILE}:ro')}"
    if host.device == fleet.session_host and fleet.weights is not None and fleet.weights_url is None:
        # a GGUF file alone (its folder's other files stay out); its in-place folder goes to the cache
        mount += f" -v {word(f'{fleet.weights}:{member_model(fleet, host)}:ro')}"
    remove_old = f"docker rm -f {shlex.quote(name)} >/dev/null 2>&1;"
    return f"{remove_old} {shlex.join(argv)}{mount} {shlex.join([image, *args])}"


def native_start(fleet: FleetFile, host: Host, args: list[str]) -> str:
    """A native member through the host's service manager (never a backgrounded shell); the session
    host's old code file goes first, so that `up` never reads a previous session's code."""
    kafila = [host.python, "-m", "kafila", *args]
    fresh = f"mkdir -p {state_dir(fleet)}"
    if args[:1] == ["host"]:
        fresh += f" && rm -f {code_file(fleet, host)}"

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


def start(fleet: FleetFile, host: Host, image: str, code: str, join: bool = False) -> Step:
    """Start the member: the session host opening the session, or a member joining with `code`
    (`join`: the session host joining the session it handed its role over in)."""
    args = member_args(fleet, host, code, code_file(fleet, host), join)
    role = "start the session host member" if args[0] == "host" else "start joining member"
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


def keep_code(fleet: FleetFile, host: Host) -> Step:
    """Write the session code (on the remote's standard input, never in a command line) where the
    session host member keeps it (`code_file`): a session host that handed its role over and joined
    again keeps it for the next rolling upgrade, as the member that opened the session did."""
    if host.runtime == "docker":
        remote = shlex.join(
            ["docker", "exec", "-i", unit(fleet, host), "sh", "-c", f"cat > {CONTAINER_CODE_FILE}"]
        )
    else:
        path = code_file(fleet, host)
        remote = f"umask 077 && mkdir -p {state_dir(fleet)} && cat > {path}.tmp && mv -f {path}.tmp {path}"
    return Step(host, "keep the session code", remote)


def read_code(fleet: FleetFile, host: Host) -> Step:
    if host.runtime == "docker":
        remote = shlex.join(["docker", "exec", unit(fleet, host), "cat", CONTAINER_CODE_FILE])
    else:
        remote = f"cat {code_file(fleet, host)}"
    return Step(host, "read the session code", remote)


# Run by the member's interpreter on a native host: imports what `kafila host|join` (or `kafila
# rendezvous`) imports and finds every installed dependency the package asks for (`import kafila`
# alone passes with none: the package's __init__ imports nothing); prints the versions, or exits 1
# naming what is missing.
PREFLIGHT = """\
import importlib, importlib.metadata as md, re, sys
role = sys.argv[1]
where = f"python {sys.version.split()[0]} ({sys.executable})"
try:
    version, reqs = md.version("kafila"), md.requires("kafila") or []
except md.PackageNotFoundError:
    version, reqs = None, []
extras = ("", "engine") if role == "member" else ("",)
missing = []
for req in reqs:
    spec, _, marker = req.partition(";")
    extra = re.search(r'extra == "([^"]+)"', marker)
    if (extra.group(1) if extra else "") not in extras:
        continue
    dist = re.split(r"[=<>!~\\[ ]", spec.strip(), maxsplit=1)[0]
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        missing.append(spec.strip())
member = ["kafila.cli.host", "kafila.session.forming.host"]
for m in ["kafila.rendezvous.server"] if role == "rendezvous" else member:
    try:
        importlib.import_module(m)
    except ImportError as e:
        missing.append(f"{m} ({e})")
if missing:
    extra = "" if role == "rendezvous" else "[torch]"
    sys.exit(f"{where}: kafila {version or '(not installed)'} cannot run a {role}: missing "
             + ", ".join(missing) + f"; install it into this interpreter ({sys.executable} -m pip install"
             f" 'kafila{extra}'), or name the interpreter or venv that has it in the fleet file")
import kafila
print(f"{where}, kafila {version or kafila.__version__ + ' (not installed: from sys.path)'}"
      f" at {kafila.__file__.rsplit('/', 2)[0]}")
"""


def role(host: Host) -> str:
    return "rendezvous" if host.device == "rendezvous" else "member"


def check_weights(fleet: FleetFile, host: Host) -> Step:
    """The session host's [fleet] weights: a folder there with config.json, *.safetensors and
    tokenizer.json; for a container also readable by its user (another uid, through a read-only bind
    mount) and no symlink leaving the folder (a Hugging Face cache snapshot's links into ../../blobs
    point nowhere inside the container). A GGUF file: check_gguf. Prints what it found, or exits 1
    naming what is missing."""
    assert fleet.weights is not None
    if fleet.weights_gguf is not None:
        return check_gguf(fleet, host)
    d = word(fleet.weights)
    remote = (
        f"d={d};"
        ' if [ ! -e "$d" ]; then echo "no such folder: $d" >&2; exit 1; fi;'
        ' if [ ! -d "$d" ]; then echo "$d is a file, not a model folder (config.json, *.safetensors,'
        ' tokenizer.json): kafila host loads a folder" >&2; exit 1; fi;'
        ' m=; [ -f "$d/config.json" ] || m="$m config.json";'
        ' [ -f "$d/tokenizer.json" ] || m="$m tokenizer.json";'
        ' set -- "$d"/*.safetensors; [ -f "$1" ] || m="$m *.safetensors";'
        ' if [ -n "$m" ]; then echo "$d lacks$m (a Hugging Face model folder has them)" >&2; exit 1; fi;'
    )
    if host.runtime == "docker":
        remote += (
            ' r=$(cd "$d" && pwd -P) || exit 1; out=;'
            ' for f in "$d"/*; do [ -L "$f" ] || continue; t=$(readlink -f "$f");'
            ' case "$t" in "$r"/*) ;; *) out="$out ${f##*/}";; esac; done;'
            ' if [ -n "$out" ]; then echo "$d has symlinks out of the folder, which the container'
            " cannot follow:$out; copy real files in (a Hugging Face cache snapshot: hf download"
            ' --local-dir DIR)" >&2; exit 1; fi;'
            r' no=$(find -L "$d" -maxdepth 1 \( -type f ! -perm -004 \) -o \( -type d ! -perm -005 \));'
            f' if [ -n "$no" ]; then echo "the container\'s user (uid {CONTAINER_UID}) cannot read:"'
            ' $no "; make it world-readable: chmod -R o+rX $d" >&2; exit 1; fi;'
        )
    remote += ' echo "$d: config.json, tokenizer.json, $# safetensors file(s), $(du -skL "$d" | cut -f1) KiB"'
    return Step(host, f"check the model weights {fleet.weights}", remote)


def check_gguf(fleet: FleetFile, host: Host) -> Step:
    """[fleet] weights as a GGUF file on the session host: a file there that starts as a GGUF does,
    readable by the member (the ssh user; for a container also its user, another uid, through the
    read-only bind mount of the file itself, which checks only the file's own mode). `kafila host`
    converts it in place into the member's cache (the container's volume), so nothing else is needed."""
    assert fleet.weights is not None
    remote = (
        f"f={word(fleet.weights)};"
        ' if [ ! -e "$f" ]; then echo "no such file: $f" >&2; exit 1; fi;'
        ' if [ ! -f "$f" ]; then echo "$f is not a file: a .gguf weights path names the GGUF file" >&2;'
        " exit 1; fi;"
        ' if [ ! -r "$f" ]; then echo "$(id -un) cannot read $f" >&2; exit 1; fi;'
        ' if [ "$(head -c 4 "$f" 2>/dev/null)" != GGUF ]; then'
        ' echo "$f is not a GGUF file (it does not start with GGUF)" >&2; exit 1; fi;'
    )
    if host.runtime == "docker":
        remote += (
            ' if [ -z "$(find -L "$f" -maxdepth 0 -perm -004)" ]; then'
            f" echo \"the container's user (uid {CONTAINER_UID}) cannot read: $f ; make it world-readable:"
            ' chmod o+r $f" >&2; exit 1; fi;'
        )
    remote += ' echo "$f: a GGUF file, $(du -kL "$f" | cut -f1) KiB"'
    return Step(host, f"check the model weights {fleet.weights}", remote)


def checks(fleet: FleetFile, host: Host, image: str) -> list[Step]:
    steps = _runtime_checks(fleet, host, image)
    if host.device == fleet.session_host and fleet.weights is not None and fleet.weights_url is None:
        steps.append(check_weights(fleet, host))
    return steps


def _runtime_checks(fleet: FleetFile, host: Host, image: str) -> list[Step]:
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
        Step(
            host,
            f"check kafila and its dependencies in {host.python}",
            _words([host.python, "-c", PREFLIGHT, role(host)]),
        ),
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


DOCKER_UP = (
    "out=$(docker version --format '{{.Server.Version}}' 2>&1 >/dev/null)"
    ' || { echo "docker not running: $out" >&2; exit 3; };'
)
ACTIVE = "active|activating|reloading|deactivating"  # a systemd unit whose process may still run


def stop(fleet: FleetFile, host: Host) -> Step:
    """Remove what `up` started on the host, and the fleet's key files and state there; prints what
    it removed. Idempotent (nothing there is not an error); a removal that fails exits non-zero with
    the reason on stderr, leaving the keys in place, so that a second `down` finishes the job."""
    keys = f"{word(f'{KEY_DIR}/{fleet.name}')} {state_dir(fleet)}"
    files = f" rm -rf {keys} || exit 1; rmdir {word(KEY_DIR)} {word(CACHE_DIR)} >/dev/null 2>&1;"
    if host.runtime == "docker":
        label = shlex.quote(f"label={LABEL_FLEET}={fleet.name}")
        remote = (
            f"{DOCKER_UP} names=$(docker ps -a --filter {label} --format '{{{{.Names}}}}') || exit 1;"
            ' if [ -n "$names" ]; then docker rm -f $names >/dev/null || exit 1;'
            ' echo "removed container(s)" $names; fi;'
            f" vols=$(docker volume ls -q --filter {label}) || exit 1;"
            ' if [ -n "$vols" ]; then docker volume rm $vols >/dev/null || exit 1;'
            ' echo "removed volume(s)" $vols; fi;'
            f'{files} [ -n "$names$vols" ] || echo "no containers or volumes of fleet {fleet.name} there"'
        )
        return Step(host, "remove the fleet's containers and volumes", remote)
    if host.os == "linux":
        name = shlex.quote(unit(fleet, host) + ".service")
        remote = (
            f's=$(systemctl --user is-active {name} 2>&1); case "$s" in'
            f' {ACTIVE}) systemctl --user stop {name} || exit 1; did="stopped {name}";;'
            f' inactive|failed|unknown) did="{name} was not running";;'
            ' *) echo "systemctl --user is-active did not answer: $s" >&2; exit 1;; esac;'
            f" systemctl --user reset-failed {name} >/dev/null 2>&1;"
            f' s=$(systemctl --user is-active {name} 2>&1); case "$s" in'
            f' {ACTIVE}) echo "{name} is still $s after systemctl stop" >&2; exit 1;; esac;'
            f'{files} echo "$did"'
        )
        return Step(host, f"stop service {unit(fleet, host)}", remote)
    label = shlex.quote(launchd_label(fleet, host))
    target = f"gui/$(id -u)/{label}"
    remote = (
        f"if launchctl print {target} >/dev/null 2>&1; then launchctl bootout {target} || exit 1;"
        f' did="stopped {label}"; else did="{label} was not loaded"; fi;'
        f' rm -f "$HOME"/Library/LaunchAgents/{label}.plist || exit 1;{files} echo "$did"'
    )
    return Step(host, f"stop launchd agent {launchd_label(fleet, host)}", remote)


LEAVE_S = 60  # how long a member has to leave its session on SIGTERM before it is killed


def leave(fleet: FleetFile, host: Host) -> Step:
    """Stop the member with SIGTERM (it closes its links; the host plans around it), waiting for it
    to end; its container or unit stays until its next start replaces it."""
    if host.runtime == "docker":
        remote = shlex.join(["docker", "stop", "-t", str(LEAVE_S), unit(fleet, host)]) + " >/dev/null"
        return Step(host, f"stop member {host.device} (container)", remote)
    if host.os == "linux":
        name = shlex.quote(unit(fleet, host) + ".service")
        return Step(host, f"stop member {host.device} (native service)", f"systemctl --user stop {name}")
    target = f"gui/$(id -u)/{shlex.quote(launchd_label(fleet, host))}"
    return Step(host, f"stop member {host.device} (launchd agent)", f"launchctl bootout {target}")


HAND_OVER_S = 90  # how long the session host has to hand its role over and end (its API drains 30 s)


def hand_over(fleet: FleetFile, host: Host) -> Step:
    """SIGUSR1 to the member that coordinates the session: it hands its role over to the first
    present member of its succession order and ends (exit 0), the session going on; waits for it
    to end, and fails when it ended otherwise. Its container or unit stays until its next start."""
    if host.runtime == "docker":
        name = shlex.quote(unit(fleet, host))
        remote = (
            f"docker kill -s USR1 {name} >/dev/null || exit 1; rc=$(docker wait {name}) || exit 1;"
            ' [ "$rc" = 0 ] || { echo "the member exited $rc instead of handing over (exit 0)" >&2; exit 1; }'
        )
        return Step(host, f"hand the session's host role over and stop {host.device} (container)", remote)
    if host.os == "linux":
        name = shlex.quote(unit(fleet, host) + ".service")
        remote = (
            f"systemctl --user kill -s USR1 {name} || exit 1;"
            f" while systemctl --user is-active --quiet {name}; do sleep 0.5; done"
        )
        return Step(
            host, f"hand the session's host role over and stop {host.device} (native service)", remote
        )
    target = f"gui/$(id -u)/{shlex.quote(launchd_label(fleet, host))}"
    remote = (
        f"launchctl kill SIGUSR1 {target} || exit 1;"
        f" while launchctl print {target} 2>/dev/null | grep -q 'state = running'; do sleep 0.5; done;"
        f" launchctl bootout {target} >/dev/null 2>&1; true"
    )
    return Step(host, f"hand the session's host role over and stop {host.device} (launchd agent)", remote)


def image_of(fleet: FleetFile, host: Host) -> Step:
    """The image id a docker member's container runs."""
    remote = shlex.join(["docker", "inspect", "--format", "{{.Image}}", unit(fleet, host)])
    return Step(host, "read the member's image", remote)


def speaks(fleet: FleetFile, host: Host, installed: bool) -> Step:
    """The kafila build's version and wire versions (kafila.proto.speaks) as JSON: in the member's
    running container, or (`installed`) the one the native host's interpreter has now."""
    if host.runtime == "docker" and not installed:
        argv = ["docker", "exec", unit(fleet, host), "python", "-m", "kafila.proto.speaks"]
        return Step(host, "read the running build's wire versions", shlex.join(argv))
    return Step(
        host,
        f"read the wire versions of kafila in {host.python}",
        _words([host.python, "-m", "kafila.proto.speaks"]),
    )


def down_steps(fleet: FleetFile, coordinator: str | None = None) -> list[Step]:
    """Joiners first, then the member that coordinates the session (`coordinator`, default the
    session host: another after a rolling upgrade handed the role over), then the rendezvous: once
    per docker host (by label)."""
    steps: list[Step] = []
    seen: set[str] = set()
    last = coordinator or fleet.session_host
    members = sorted(reversed(fleet.hosts), key=lambda h: h.device == last)  # stable: the rest as listed
    everyone = [*members, *([fleet.rendezvous.host] if fleet.rendezvous.host else [])]
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
    """The container's or service's state: one line, which `member_state` reads."""
    if host.runtime == "docker":
        remote = (
            "command -v docker >/dev/null 2>&1 || { echo 'docker missing'; exit 0; };"
            " docker version --format '{{.Server.Version}}' >/dev/null 2>&1"
            " || { echo 'docker not running'; exit 0; }; "
            + shlex.join(["docker", "inspect", "--format", "{{.State.Status}}", unit(fleet, host)])
            + " 2>/dev/null || echo absent"
        )
        return Step(host, "container state", remote)
    if host.os == "linux":
        name = shlex.quote(unit(fleet, host) + ".service")
        return Step(host, "service state", f"systemctl --user is-active {name} 2>&1; true")
    label = shlex.quote(launchd_label(fleet, host))
    return Step(
        host,
        "agent state",
        f"s=$(launchctl print gui/$(id -u)/{label} 2>/dev/null"
        " | sed -n 's/^[[:space:]]*state = //p' | head -n1); echo \"${s:-absent}\"",
    )


# What a member's process is doing, as `status` shows it and `up` watches it: running, exited
# (it ran and ended), absent (nothing of it there), docker not running, docker missing,
# unreachable (ssh could not log in), error (the service manager gave no state), or a transient
# word of the runtime (created, restarting, paused, removing, stopping).
RUNNING, EXITED, ABSENT, UNREACHABLE = "running", "exited", "absent", "unreachable"
HOST_FAILED = (UNREACHABLE, "docker not running", "docker missing", "error")  # the host, not the member
GONE = (EXITED, ABSENT, "removing", "stopping")

_WORDS = {
    "docker": {"running": RUNNING, "exited": EXITED, "dead": EXITED, "absent": ABSENT},
    "linux": {
        "active": RUNNING,
        "reloading": RUNNING,
        "activating": "starting",
        "deactivating": "stopping",
        "failed": EXITED,
        "inactive": ABSENT,
        "unknown": ABSENT,  # --collect: an ended unit is gone
    },
    "macos": {"running": RUNNING, "not running": EXITED, "exited": EXITED, "absent": ABSENT},
}
_DOCKER_HOST = ("docker not running", "docker missing")
_TRANSIENT = ("created", "restarting", "paused", "removing")


def member_state(host: Host, ssh_rc: int, out: str) -> str:
    """The state `state(...)`'s command printed (with ssh's exit status: 255 is ssh's own failure)."""
    if ssh_rc == 255:
        return UNREACHABLE
    line = (out.strip().splitlines() or [""])[0].strip()
    kind = "docker" if host.runtime == "docker" else host.os
    if kind == "docker" and line in (*_DOCKER_HOST, *_TRANSIENT):
        return line
    return _WORDS[kind].get(line, "error")
