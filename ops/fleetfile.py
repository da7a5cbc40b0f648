"""Fleet files for `kafila-ops`: the planner's [session] and [[device]] plus where each member runs.

[fleet]
name = "uscentral"                 # labels containers and services: dev.kafila.fleet=NAME
image = "kafila/member:cuda"       # the member image (Dockerfile.cuda) for docker hosts
session_host = "a100"              # the device that opens the session (default: the first [[device]])
ssh_config = "ssh_config"          # optional: an ssh config file (-F), relative to the fleet file
api_key_file = "keys/fleet.key"    # optional: API keys (one a line) every member's API asks for; a
                                   # local file, relative to the fleet file. `up` ships it to each host
                                   # (0600) and starts members with --api-key-file; kafila-ops sends
                                   # its first key with every request it makes to a member's API
weights = "/srv/models/Qwen3-8B"   # the model's folder on the session host (absolute, or ~/ for the
                                   # ssh user's home): config.json, *.safetensors, tokenizer.json; or
                                   # a GGUF file there ("/srv/models/qwen3-8b.Q4_K_M.gguf"), which
                                   # `kafila host` converts in place into its cache (no copy). A
                                   # docker host mounts it read-only (actions.CONTAINER_WEIGHTS/NAME),
                                   # a native one passes the path as --model; `up` checks it there
                                   # before anything starts. Or an HTTP(S) mirror or hub URL
                                   # ("https://huggingface.co/Qwen/Qwen3-8B"): the session host gets
                                   # --weights-from URL and fetches [session] model from it into its
                                   # cache, members fetch ranges from it too; `up` checks that it
                                   # answers the files first. Needed for a planning preset's model
                                   # (qwen3-*); a default model (smollm2-135m) ships in the package

[rendezvous]                       # either an existing one ...
url = "wss://rdv.example.org:8470/v1/signal"
# ... or one the fleet starts (a container of `image`, default kafila/rendezvous:latest):
# ssh = "ops@rdv.example.org"      # where it runs
# address = "203.0.113.7"          # the address members reach it at
# alt_address = "203.0.113.8"      # optional second public address: NAT filtering is classified
# port = 8470

[session] / [[device]]             # as `kafila plan` reads them (kafila/planner/fleet.py)

[[site]]
name = "des-moines"
api_key_file = "keys/des-moines.key"  # optional: this site's members' keys instead of [fleet]'s
[[site.host]]
device = "a100"                    # the [[device]] this host runs (its member name)
ssh = "ops@a100.example.org"       # ssh destination (a Host of ssh_config, user@host, ...)
runtime = "docker"                 # docker | native
gpus = "all"                       # docker: --gpus value; "none" for CPU hosts (default all)
python = "~/kafila/bin/python"     # native: the interpreter with kafila installed (or venv = DIR, the
                                   # environment's folder); `up` checks it imports kafila's command
                                   # line and its dependencies, and prints its Python and kafila versions
os = "linux"                       # native: linux (systemd-run --user) | macos (launchd user agent)
api = "127.0.0.1:11434"            # the member's API address (default; another needs an api_key_file,
                                   # or args' --insecure-no-key to serve it open on purpose)
metrics_port = 9464                # the member's --metrics listener, on the API's address, which `monitor`
                                   # tunnels to (default 9464; the API's port: no listener, its /metrics)
args = ["--threads", "2"]          # extra `kafila host|join` flags
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafila.api.security import is_loopback
from kafila.planner.fleet import Fleet, FleetError, no_unknown, parse_fleet

NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
RUNTIMES = ("docker", "native")
OSES = ("linux", "macos")
DEFAULT_API = "127.0.0.1:11434"
DEFAULT_METRICS_PORT = 9464  # a member's `--metrics` listener (Prometheus's port range for exporters)
DEFAULT_RDV_PORT = 8470
DEFAULT_RDV_IMAGE = "kafila/rendezvous:latest"

_FLEET_KEYS = {"name", "image", "session_host", "ssh_config", "api_key_file", "weights"}
_RDV_KEYS = {
    "url",
    "ssh",
    "address",
    "alt_address",
    "port",
    "udp_port",
    "udp_alt_port",
    "image",
    "runtime",
    "python",
    "venv",
    "os",
}
_SITE_KEYS = {"name", "host", "api_key_file"}
_HOST_KEYS = {"device", "ssh", "runtime", "gpus", "python", "venv", "os", "api", "metrics_port", "args"}


@dataclass(frozen=True)
class Host:
    """One machine of a site and the member it runs."""

    site: str
    device: str  # the member's name
    ssh: str
    runtime: str  # docker | native
    gpus: str  # docker: --gpus value, "none" for none
    python: str  # native: the interpreter
    os: str  # native: linux | macos
    api: str  # HOST:PORT the member's API listens on, on that machine
    metrics_port: int  # the --metrics listener's, on the API's address (the API's own port: none)
    args: tuple[str, ...]
    api_key_file: str | None = None  # local file of the keys the member's API asks for (None: no key)

    @property
    def api_port(self) -> int:
        return int(self.api.rsplit(":", 1)[1])

    @property
    def local_api(self) -> str:
        """The API as seen from the machine itself (a wildcard listener answers on loopback)."""
        addr, port = self.api.rsplit(":", 1)
        return f"{'127.0.0.1' if addr in ('0.0.0.0', '::', '[::]', '') else addr}:{port}"

    @property
    def metrics(self) -> str | None:
        """The member's `--metrics` address: the API's host at `metrics_port` (None: the API's port,
        whose /metrics `monitor` then reads)."""
        if self.metrics_port == self.api_port:
            return None
        return f"{self.api.rsplit(':', 1)[0]}:{self.metrics_port}"


@dataclass(frozen=True)
class Rendezvous:
    url: str  # the signaling URL members are given
    host: Host | None  # set when the fleet starts it
    image: str
    port: int
    udp_port: int
    udp_alt_port: int
    address: str = ""  # the address members reach a rendezvous the fleet starts at
    alt_address: str | None = None  # its second public address, if it has one


@dataclass(frozen=True)
class FleetFile:
    name: str
    image: str
    session_host: str
    ssh_config: str | None
    rendezvous: Rendezvous
    plan: Fleet  # the planner's view: [session] and [[device]] (session host first)
    hosts: tuple[Host, ...]  # session host first, then in file order
    weights: str | None = (
        None  # the model's folder or GGUF file on the session host, or a mirror URL (None: the model's name)
    )

    @property
    def weights_url(self) -> str | None:
        """[fleet] weights when it is a mirror URL (the session host fetches the model from it)."""
        return self.weights if self.weights is not None and "://" in self.weights else None

    @property
    def weights_gguf(self) -> str | None:
        """[fleet] weights when it is a GGUF file on the session host (`kafila host` converts it in place)."""
        return self.weights if self.weights is not None and is_gguf_path(self.weights) else None

    @property
    def joiners(self) -> tuple[Host, ...]:
        return self.hosts[1:]

    def host(self, member: str) -> Host:
        for h in self.hosts:
            if h.device == member:
                return h
        raise FleetError(
            f"fleet {self.name}: no member {member!r}; members: {[h.device for h in self.hosts]}"
        )


ReadJson = Callable[[str], Any]


def load(path: Path) -> FleetFile:
    """Read a fleet file; probe files and ssh_config are relative to it."""
    import json

    try:
        text = path.read_text()
    except OSError as exc:
        raise FleetError(f"cannot read fleet file {path}: {exc.strerror or exc}") from None
    from dataclasses import replace

    fleet = parse(text, str(path), lambda p: json.loads((path.parent / p).read_text()))
    if fleet.ssh_config is not None and not Path(fleet.ssh_config).is_absolute():
        fleet = replace(fleet, ssh_config=str(path.parent / fleet.ssh_config))
    hosts = []
    for h in fleet.hosts:
        if h.api_key_file is not None:
            key_file = path.parent / h.api_key_file  # an absolute path stays itself
            api_key(replace(h, api_key_file=str(key_file)), f"{path}: site {h.site!r} ({h.device})")
            h = replace(h, api_key_file=str(key_file))
        hosts.append(h)
    return replace(fleet, hosts=tuple(hosts))


def api_key(host: Host, where: str = "") -> str | None:
    """The key kafila-ops sends to the member's API (the first of its key file), read and checked as
    the member checks it (kafila.api.security); None when the API asks for none."""
    from kafila.api.security import ApiSecurity, ApiSecurityError, load_keys

    if host.api_key_file is None:
        return None
    where = where or f"host {host.device} (site {host.site})"
    try:
        keys = load_keys(host.api_key_file)
        ApiSecurity(keys)  # each key long enough, no spaces
    except ApiSecurityError as exc:
        raise FleetError(f"{where}: api_key_file: {exc}") from None
    return keys[0]


def parse(text: str, source: str = "fleet", read_json: ReadJson | None = None) -> FleetFile:
    plan = parse_fleet(text, source, read_json)  # [session] and [[device]], with its own clear errors
    data = tomllib.loads(text)
    fleet = data.get("fleet")
    if fleet is None:
        raise FleetError(f"{source}: needs a [fleet] table with name and image (kafila-ops fleet files)")
    where = f"{source}: [fleet]"
    _no_unknown(fleet, _FLEET_KEYS, where)
    name = _name(fleet, "name", where)
    image = _text(fleet, "image", where)
    ssh_config = _text(fleet, "ssh_config", where) if "ssh_config" in fleet else None
    devices = [d.name for d in plan.devices]
    key_file = _text(fleet, "api_key_file", where) if "api_key_file" in fleet else None
    hosts = _hosts(data.get("site"), source, devices, key_file)
    session_host = plan.devices[0].name  # parse_fleet put [fleet] session_host first
    hosts = sorted(hosts, key=lambda h: h.device != session_host)
    weights = _weights(fleet, plan.model, session_host, where)
    return FleetFile(
        name=name,
        image=image,
        session_host=session_host,
        ssh_config=ssh_config,
        rendezvous=_rendezvous(data.get("rendezvous"), source),
        plan=plan,
        hosts=tuple(hosts),
        weights=weights,
    )


def is_gguf_path(weights: str) -> bool:
    """Whether [fleet] weights names a GGUF file (by its suffix, as `kafila host --model` tells one)."""
    return weights.lower().endswith(".gguf") and "://" not in weights


def _weights(fleet: dict[str, Any], model: str, session_host: str, where: str) -> str | None:
    """[fleet] weights: the model's folder or a GGUF file on the session host, as a path there
    (absolute or ~/), or a mirror URL the session host fetches it from; required for a planning
    preset's model, whose weights no package ships. Any other single file (a .safetensors, .bin or
    .json) is refused by name: the session host loads a folder, or converts a GGUF."""
    from kafila.models.default import DEFAULT_MODELS
    from kafila.models.presets import PRESET_SOURCES

    if "weights" not in fleet:
        source = PRESET_SOURCES.get(model.lower())
        if source is not None and model not in DEFAULT_MODELS:
            raise FleetError(
                f"{where}: [session] model {model!r} is a planning preset whose weights no package "
                f"ships: download {source} (config.json, *.safetensors, tokenizer.json) to a folder on "
                f"the session host {session_host!r} and give its path there, e.g. weights = "
                f'"/srv/models/{source.rsplit("/", 1)[-1]}", or name a mirror it fetches them from, e.g. '
                f'weights = "https://huggingface.co/{source}" (docs/ops.md, Placing the weights)'
            )
        return None
    weights = _text(fleet, "weights", where)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", weights):
        return _mirror(weights, model, where)
    if not (weights.startswith("/") or weights.startswith("~/")) or weights.strip("/~") == "":
        raise FleetError(
            f"{where}: 'weights' must be the model folder's path on the session host {session_host!r} "
            f"(or a .gguf file's), absolute or ~/ (the ssh user's home), got {weights!r}"
        )
    if re.search(r"[:,\n]", weights):
        raise FleetError(
            f"{where}: 'weights' cannot hold ':', ',' or a newline (a docker -v path), got {weights!r}"
        )
    if re.search(r"\.(safetensors|bin|json)$", weights, re.IGNORECASE):
        raise FleetError(
            f"{where}: 'weights' {weights!r} names a file: give the model's folder (config.json, "
            f"*.safetensors, tokenizer.json) or a .gguf file, which `kafila host` converts in place"
        )
    return weights.rstrip("/")


def _mirror(url: str, model: str, where: str) -> str:
    """[fleet] weights as an HTTP(S) mirror or hub URL: the session host fetches [session] model
    from it into its cache (`kafila host --model MODEL --weights-from URL`), and so do members."""
    from kafila.session.weights.mirror import mirror_base

    try:
        mirror_base(url)
    except ValueError as exc:
        raise FleetError(f"{where}: 'weights' {url!r}: {exc}") from None
    if re.search(r"\s", url):
        raise FleetError(f"{where}: 'weights' {url!r} holds a space or a newline")
    if "/" in model:
        raise FleetError(
            f"{where}: with a mirror URL as 'weights', [session] model must be a plain name (the "
            f"folder the session host fetches it into), got {model!r}"
        )
    return url.rstrip("/")


def _hosts(sites: Any, source: str, devices: list[str], fleet_key_file: str | None) -> list[Host]:
    if not isinstance(sites, list) or not sites:
        raise FleetError(f"{source}: needs at least one [[site]] with [[site.host]] tables")
    hosts: list[Host] = []
    site_names: list[str] = []
    for i, site in enumerate(sites):
        where = f"{source}: site #{i + 1}"
        if not isinstance(site, dict):
            raise FleetError(f"{where}: must be a table")
        _no_unknown(site, _SITE_KEYS, where)
        sname = _name(site, "name", where)
        if sname in site_names:
            raise FleetError(f"{source}: site names must be unique, repeated: {sname!r}")
        site_names.append(sname)
        tables = site.get("host")
        if not isinstance(tables, list) or not tables:
            raise FleetError(f"{source}: site {sname!r}: needs at least one [[site.host]] table")
        key_file = _text(site, "api_key_file", where) if "api_key_file" in site else fleet_key_file
        hosts += [
            _host(t, f"{source}: site {sname!r} host #{j + 1}", sname, devices, key_file)
            for j, t in enumerate(tables)
        ]
    ran = [h.device for h in hosts]
    twice = sorted({d for d in ran if ran.count(d) > 1})
    if twice:
        raise FleetError(f"{source}: a device runs on one host only, given twice: {twice}")
    missing = [d for d in devices if d not in ran]
    if missing:
        raise FleetError(
            f"{source}: no [[site.host]] runs device(s) {missing}: add `device = NAME` to a host"
        )
    return hosts


def _check_api_exposure(api: str, args: list[str], key_file: str | None, where: str) -> None:
    """A member refuses an API open to other machines without a key (kafila.api.security): say so
    here, before anything starts on any host. Keys come from the fleet file's `api_key_file`, which
    kafila-ops ships to the hosts and sends with its own requests, never from a member's `args`."""
    if "--api-key-file" in args:
        raise FleetError(
            f'{where}: give the member\'s API keys as `api_key_file = "FILE"` in [fleet] or in its '
            f"[[site]] (a local file: `up` ships it to the host and kafila-ops sends the key with its "
            f"own requests), not --api-key-file in 'args'"
        )
    if key_file is not None and "--insecure-no-key" in args:
        raise FleetError(f"{where}: api_key_file and '--insecure-no-key' in 'args' contradict each other")
    if key_file is not None or is_loopback(api.rsplit(":", 1)[0]) or "--insecure-no-key" in args:
        return
    raise FleetError(
        f"{where}: api {api} is open to other machines, which a member refuses without an API key: "
        f"give `api_key_file` in [fleet] or the host's [[site]], serve 127.0.0.1 (the default; "
        f"kafila-ops reaches members over ssh), or add '--insecure-no-key' to 'args' to serve it open "
        f"on purpose"
    )


def _host(t: Any, where: str, site: str, devices: list[str], key_file: str | None) -> Host:
    if not isinstance(t, dict):
        raise FleetError(f"{where}: must be a table")
    _no_unknown(t, _HOST_KEYS, where)
    device = _text(t, "device", where)
    if device not in devices:
        raise FleetError(f"{where}: device {device!r} is not a [[device]] name; devices: {devices}")
    where = f"{where} ({device})"
    runtime = _choice(t, "runtime", RUNTIMES, where, "docker")
    os_name = _choice(t, "os", OSES, where, "linux")
    if runtime == "docker" and os_name != "linux":
        raise FleetError(f"{where}: runtime 'docker' runs on linux hosts; macOS members run natively")
    python = _interpreter(t, where)
    api = _text(t, "api", where) if "api" in t else DEFAULT_API
    if (
        not re.fullmatch(r"[^\s:]*:\d{1,5}|\[[0-9a-fA-F:]+\]:\d{1,5}", api)
        or not 0 < int(api.rsplit(":", 1)[1]) < 65536
    ):
        raise FleetError(f"{where}: 'api' must be HOST:PORT with a port 1-65535, got {api!r}")
    metrics_port = _port(t, "metrics_port", where, DEFAULT_METRICS_PORT)
    args = t.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise FleetError(f"{where}: 'args' must be a list of strings, got {args!r}")
    _check_api_exposure(api, args, key_file, where)
    if key_file is not None and metrics_port == int(api.rsplit(":", 1)[1]):
        raise FleetError(
            f"{where}: with an API key, 'metrics_port' must differ from the API's port: the API's "
            f"/metrics needs the key, which the Prometheus targets `monitor` writes cannot carry"
        )
    return Host(
        site=site,
        device=device,
        ssh=_text(t, "ssh", where),
        runtime=runtime,
        gpus=_text(t, "gpus", where) if "gpus" in t else "all",
        python=python,
        os=os_name,
        api=api,
        metrics_port=metrics_port,
        args=tuple(args),
        api_key_file=key_file,
    )


def _interpreter(t: dict[str, Any], where: str) -> str:
    """A native member's interpreter: `python` (a command or a path on the host) or `venv` (a virtual
    environment's folder there, whose bin/python runs it); default python3. `up` checks on the host
    that it imports kafila's command line with its dependencies."""
    if "python" in t and "venv" in t:
        raise FleetError(f"{where}: give 'python' (an interpreter) or 'venv' (its environment), not both")
    if "venv" in t:
        venv = _text(t, "venv", where).rstrip("/")
        if re.search(r"/bin/python[\d.]*$", venv) or not venv:
            raise FleetError(
                f"{where}: 'venv' names the environment's folder (its bin/python runs the member), got "
                f"{t['venv']!r}: give venv = {re.sub(r'/bin/python[0-9.]*$', '', venv) or '/'!r} or "
                f"python = {venv!r}"
            )
        return f"{venv}/bin/python"
    python = _text(t, "python", where) if "python" in t else "python3"
    if python.endswith("/") or python != python.strip() or "\n" in python:
        raise FleetError(
            f"{where}: 'python' must be an interpreter (a command such as python3.11, or its path on the "
            f"host), got {python!r}; for a virtual environment's folder give venv = FOLDER"
        )
    return python


def _rendezvous(t: Any, source: str) -> Rendezvous:
    where = f"{source}: [rendezvous]"
    if not isinstance(t, dict):
        raise FleetError(
            f"{where}: missing: give `url` (an existing rendezvous) or `ssh` (one the fleet starts)"
        )
    _no_unknown(t, _RDV_KEYS, where)
    if ("url" in t) == ("ssh" in t):
        raise FleetError(
            f"{where}: give exactly one of `url` (an existing rendezvous) or `ssh` (one the fleet starts)"
        )
    port = _port(t, "port", where, DEFAULT_RDV_PORT)
    udp, alt = _port(t, "udp_port", where, 3478), _port(t, "udp_alt_port", where, 3479)
    image = _text(t, "image", where) if "image" in t else DEFAULT_RDV_IMAGE
    if "url" in t:
        url = _text(t, "url", where)
        if not re.match(r"^(wss?|https?)://", url):
            raise FleetError(
                f"{where}: 'url' must start with ws://, wss://, http:// or https://, got {url!r}"
            )
        return Rendezvous(url, None, image, port, udp, alt)
    address = _text(t, "address", where) if "address" in t else None
    ssh = _text(t, "ssh", where)
    if address is None:
        raise FleetError(f"{where}: 'address' (where members reach the rendezvous {ssh!r} starts) is missing")
    runtime = _choice(t, "runtime", RUNTIMES, where, "docker")
    host = Host(
        site="rendezvous",
        device="rendezvous",
        ssh=ssh,
        runtime=runtime,
        gpus="none",
        python=_interpreter(t, where),
        os=_choice(t, "os", OSES, where, "linux"),
        api=f"{address}:{port}",
        metrics_port=port,
        args=(),
    )
    alt_address = _text(t, "alt_address", where) if "alt_address" in t else None
    return Rendezvous(f"ws://{address}:{port}/v1/signal", host, image, port, udp, alt, address, alt_address)


def _no_unknown(t: dict[str, Any], allowed: set[str], where: str) -> None:
    no_unknown(t, allowed, where, cutoff=0.6)  # short names: 'shh' is 0.67 like 'ssh'


def _text(t: dict[str, Any], key: str, where: str) -> str:
    v = t.get(key)
    if v is None:
        raise FleetError(f"{where}: missing '{key}'")
    if not isinstance(v, str) or not v.strip():
        raise FleetError(f"{where}: '{key}' must be a non-empty string, got {v!r}")
    return v


def _name(t: dict[str, Any], key: str, where: str) -> str:
    v = _text(t, key, where)
    if not NAME.match(v):
        raise FleetError(
            f"{where}: '{key}' must be lower-case letters, digits, '.', '_' or '-' (at most 63), got {v!r}"
        )
    return v


def _choice(t: dict[str, Any], key: str, choices: tuple[str, ...], where: str, default: str) -> str:
    v = t.get(key, default)
    if v not in choices:
        raise FleetError(f"{where}: '{key}' must be one of {list(choices)}, got {v!r}")
    return str(v)


def _port(t: dict[str, Any], key: str, where: str, default: int) -> int:
    v = t.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < 65536:
        raise FleetError(f"{where}: '{key}' must be a port 1-65535, got {v!r}")
    return v
