"""`kafila rendezvous`: run the always-on rendezvous (signaling, NAT probes, relay)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import ipaddress
from collections.abc import Callable
from typing import TYPE_CHECKING

from kafila.cli.argtypes import port_number, positive_int, positive_number
from kafila.proto.signaling import DEFAULT_PORT

if TYPE_CHECKING:
    from kafila.rendezvous.udp import ListenError

_LIMIT_HELP = {
    "max_message_bytes": "largest signaling frame accepted, in bytes",
    "max_bad_frames": "malformed frames in a row before a connection is closed",
    "max_connections": "signaling connections at once",
    "max_connections_per_address": "signaling connections at once from one source address",
    "max_sessions": "open sessions at once",
    "max_members": "members in one session",
    "code_ttl_s": "seconds a session code keeps accepting joins after the last open/join",
    "heartbeat_s": "heartbeat interval members are told to keep, in seconds",
    "heartbeat_timeout_s": "seconds of silence after which a member is timed out",
    "join_rate_per_address": "join challenges per second allowed from one source address (IPv6: /48)",
    "join_burst_per_address": "burst of join challenges allowed from one source address",
    "failed_proof_rate_per_session": "wrong code secrets tested per second on one session, once an "
    "address has failed (an address that never failed is always tested)",
    "failed_proof_burst_per_session": "burst of wrong code secrets tested on one session",
    "failed_proof_rate": "wrong code secrets tested per second on the whole rendezvous",
    "failed_proof_burst": "burst of wrong code secrets tested on the whole rendezvous",
    "failed_proof_backoff_s": "an address's wait after its first wrong code secret, doubling with each",
    "failed_proof_backoff_max_s": "the longest wait of an address that gave wrong code secrets",
    "failed_proof_memory_s": "seconds an address that gave a wrong code secret is remembered",
    "challenge_s": "seconds a join nonce stays good",
    "open_rate_per_address": "sessions opened per second allowed from one source address",
    "open_burst_per_address": "burst of sessions opened from one source address",
    "relay_channels": "relay channels at once, all sessions together (0: no relay)",
    "relay_channels_per_session": "relay channels one session may hold (0: no relay)",
    "relay_session_bytes_per_s": "bytes per second the relay forwards for one session (0: unlimited)",
    "relay_idle_s": "seconds without traffic after which a relay channel is removed",
    "relay_recover_s": "seconds after a start in which relay channels from before it come back when "
    "their legs re-bind (with --relay-secret-file; 0: never)",
}


def _limit_type(name: str, whole: bool) -> Callable[[str], float]:
    """The argparse type of limit `name`: `positive_int`/`positive_number`, or Limits' own rule."""
    from kafila.rendezvous.limits import MIN_MESSAGE_BYTES, ZERO_ALLOWED, limit_problem

    if name not in ZERO_ALLOWED and name != "max_message_bytes":
        return positive_int if whole else positive_number

    def parse(text: str) -> float:
        try:
            value: float = int(text) if whole else float(text)
        except ValueError:
            value = -1.0 if whole else float("nan")
        problem = limit_problem(name, value)
        if problem:
            bound = f">= {MIN_MESSAGE_BYTES}" if name == "max_message_bytes" else ">= 0"
            kind = "a whole number" if whole else "a finite number"
            raise argparse.ArgumentTypeError(f"must be {kind} {bound}, got {text!r}")
        return value

    return parse


def metrics_address(text: str) -> str:
    """--metrics HOST:PORT, checked when the flags are read."""
    from kafila.obs.listener import parse_addr

    try:
        parse_addr(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    from kafila.rendezvous.limits import Limits  # light: dataclass only

    parser.add_argument(
        "--host",
        default="0.0.0.0",
        help="address for signaling (HTTP/WebSocket) (default 0.0.0.0: every interface)",
    )
    parser.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        help=f"TCP port for signaling, /healthz, /metrics (default {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--metrics",
        type=metrics_address,
        default=None,
        metavar="HOST:PORT",
        help="also serve /metrics on a listener of its own (e.g. 0.0.0.0:9465 for a Prometheus elsewhere, "
        "with the signaling port kept private) (default: /metrics on --port only)",
    )
    parser.add_argument("--udp-host", default=None, help="address for UDP probes and relay (default: --host)")
    parser.add_argument(
        "--udp-port", type=port_number, default=3478, help="primary UDP port: probes and relay (default 3478)"
    )
    parser.add_argument(
        "--udp-alt-port",
        type=port_number,
        default=3479,
        help="alternate UDP port for NAT probes (default 3479)",
    )
    parser.add_argument(
        "--udp-alt-host",
        default=None,
        help="second local address for 'reply from other address' probes (both UDP ports bind there too)",
    )
    parser.add_argument(
        "--advertise-alt-host",
        default=None,
        help="the second address as members reach it, if NAT/containers change it (default --udp-alt-host)",
    )
    parser.add_argument("--cert", default=None, help="PEM certificate chain: serve wss:// (needs --key)")
    parser.add_argument("--key", default=None, help="PEM private key for --cert")
    parser.add_argument(
        "--forwarded-allow-ips",
        default=None,
        help="behind a TLS-terminating proxy: trust its X-Forwarded-For from these IPs ('*' for any)",
    )
    parser.add_argument(
        "--relay-secret-file",
        default=None,
        metavar="PATH",
        help="the rendezvous's kept secret (hex), created (mode 0600) if missing: with the same file a "
        "restarted rendezvous takes running sessions back (their hosts re-open them) and their relay "
        "channels (default: a new secret each start, and no session outlives a restart)",
    )
    parser.add_argument(
        "--log-format",
        choices=("json", "console"),
        default=None,
        help="log lines as JSON (default for this service, or $KAFILA_LOG) or for a terminal",
    )
    limits = parser.add_argument_group("limits")
    defaults = Limits()
    for f in dataclasses.fields(Limits):
        value = getattr(defaults, f.name)
        limits.add_argument(
            "--" + f.name.replace("_", "-"),
            type=_limit_type(f.name, isinstance(value, int)),
            default=value,
            dest=f"limit_{f.name}",
            metavar="N",
            help=f"{_LIMIT_HELP[f.name]} (default {value:g})",
        )


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None  # a host name


def _wildcard(host: str) -> bool:
    address = _address(host)
    return host == "" or (address is not None and address.is_unspecified)


def flag_problems(args: argparse.Namespace) -> list[str]:
    """What no rendezvous can serve with, naming the flags (the parser checked each value alone)."""
    problems = []
    if args.udp_port and args.udp_port == args.udp_alt_port:
        problems.append(
            f"--udp-alt-port {args.udp_alt_port} is also --udp-port: the alternate port must differ "
            "from the primary"
        )
    primary, alt = args.udp_host or args.host, args.udp_alt_host
    if alt:
        same = _address(alt) == _address(primary) if _address(alt) else alt.lower() == primary.lower()
        if same:
            problems.append(
                f"--udp-alt-host {alt} is the primary UDP address (--udp-host, default --host): "
                "the alternate address must differ from the primary"
            )
        elif _wildcard(alt):
            problems.append(
                f"--udp-alt-host {alt!r} means every address, the primary included: give one specific "
                "second address"
            )
        elif _wildcard(primary):
            problems.append(
                f"--udp-alt-host needs a specific primary UDP address, but --udp-host (default --host) is "
                f"{primary!r}, which takes the UDP ports on every address, {alt} included: give the "
                "primary address as --udp-host"
            )
    elif args.advertise_alt_host:
        problems.append(
            f"--advertise-alt-host {args.advertise_alt_host} is how members reach --udp-alt-host, which "
            "is not given: nothing would listen on a second address (give both, or neither)"
        )
    beat, timeout = args.limit_heartbeat_s, args.limit_heartbeat_timeout_s
    if timeout <= beat:
        problems.append(
            f"--heartbeat-timeout-s {timeout:g} must be longer than --heartbeat-s {beat:g}: members "
            "would be timed out between heartbeats"
        )
    return problems


def relay_secret(path: str) -> tuple[bytes, bool]:
    """The relay secret in file `path` (hex, at least MIN_SECRET_BYTES), or a new one of 32 bytes written
    there with mode 0600: (secret, whether it was created)."""
    import os
    import secrets

    from kafila.rendezvous.relay import SECRET_BYTES

    if folder := os.path.dirname(path):  # e.g. a fleet's state folder on a fresh machine
        os.makedirs(folder, mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_secret(path), False
    secret = secrets.token_bytes(SECRET_BYTES)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(secret.hex() + "\n")
    return secret, True


def _read_secret(path: str) -> bytes:
    from kafila.rendezvous.relay import MIN_SECRET_BYTES

    with open(path, encoding="ascii", errors="replace") as f:
        text = f.read().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path} does not hold a hex secret") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path} holds {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed")
    return secret


def listen_hint(exc: ListenError) -> str | None:
    """What to do about a port or address that could not be bound, naming the flag that chose it."""
    flag = f"--{exc.setting.replace('_', '-')}"
    if exc.errno == errno.EADDRINUSE:
        held = "another program holds it (a rendezvous running already?)"
        return f"{held}: stop it, or choose another with {flag}"
    if exc.errno == errno.EACCES:
        return f"ports below 1024 need root (or CAP_NET_BIND_SERVICE): choose another with {flag}"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"this machine has no such address: choose one of its own with {flag}"
    return None


def main(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from kafila.obs.log import configure_logging, get_logger
    from kafila.rendezvous.limits import Limits
    from kafila.rendezvous.server import RendezvousServer, ServerConfig, TlsError
    from kafila.rendezvous.udp import ListenError

    configure_logging(args.log_format or os.environ.get("KAFILA_LOG") or "json")
    log = get_logger("kafila.rendezvous")
    if bool(args.cert) != bool(args.key):
        log.error("tls_config", error="--cert and --key go together")
        return 2
    problems = flag_problems(args)
    for problem in problems:
        log.error("bad_flags", error=problem)
    if problems:
        return 2
    limits = Limits(**{f.name: getattr(args, f"limit_{f.name}") for f in dataclasses.fields(Limits)})
    secret = None
    if args.relay_secret_file:
        try:
            secret, created = relay_secret(args.relay_secret_file)
        except (OSError, ValueError) as exc:
            log.error("relay_secret", path=args.relay_secret_file, error=str(exc))
            return 2
        log.info("relay_secret", path=args.relay_secret_file, created=created)
    config = ServerConfig(
        host=args.host,
        port=args.port,
        udp_host=args.udp_host,
        udp_port=args.udp_port,
        udp_alt_port=args.udp_alt_port,
        udp_alt_host=args.udp_alt_host,
        advertise_alt_host=args.advertise_alt_host,
        cert=args.cert,
        key=args.key,
        forwarded_allow_ips=args.forwarded_allow_ips,
        limits=limits,
        relay_secret=secret,
        metrics=args.metrics,
    )
    try:
        asyncio.run(RendezvousServer(config, handle_signals=True).serve_forever())
    except TlsError as exc:  # before anything is bound
        log.error("tls_config", error=str(exc))
        return 2
    except OSError as exc:  # a port in use or not ours to bind: named, no traceback
        hint = listen_hint(exc) if isinstance(exc, ListenError) else None
        log.error("listen_failed", error=exc.strerror or str(exc), errno=exc.errno, hint=hint)
        return 1
    return 0
