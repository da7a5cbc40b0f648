"""`kafila rendezvous`: run the always-on rendezvous (signaling, NAT probes, relay)."""

from __future__ import annotations

import argparse
import dataclasses

_LIMIT_HELP = {
    "max_message_bytes": "largest signaling frame accepted, in bytes",
    "max_bad_frames": "malformed frames in a row before a connection is closed",
    "max_connections": "signaling connections at once",
    "max_sessions": "open sessions at once",
    "max_members": "members in one session",
    "code_ttl_s": "seconds a session code keeps accepting joins after the last open/join",
    "heartbeat_s": "heartbeat interval members are told to keep, in seconds",
    "heartbeat_timeout_s": "seconds of silence after which a member is timed out",
    "join_rate_per_address": "join attempts per second allowed from one source address",
    "join_burst_per_address": "burst of join attempts allowed from one source address",
    "join_rate_per_session": "join attempts per second allowed on one session code",
    "join_burst_per_session": "burst of join attempts allowed on one session code",
    "open_rate_per_address": "sessions opened per second allowed from one source address",
    "open_burst_per_address": "burst of sessions opened from one source address",
    "relay_channels": "relay channels at once, all sessions together",
    "relay_channels_per_session": "relay channels one session may hold",
    "relay_session_bytes_per_s": "bytes per second the relay forwards for one session (0: unlimited)",
    "relay_idle_s": "seconds without traffic after which a relay channel is removed",
}


def configure(parser: argparse.ArgumentParser) -> None:
    from kafila.rendezvous.limits import Limits  # light: dataclass only

    parser.add_argument("--host", default="0.0.0.0", help="address for signaling (HTTP/WebSocket)")
    parser.add_argument("--port", type=int, default=8470, help="TCP port for signaling, /healthz, /metrics")
    parser.add_argument("--udp-host", default=None, help="address for UDP probes and relay (default: --host)")
    parser.add_argument("--udp-port", type=int, default=3478, help="primary UDP port: probes and relay")
    parser.add_argument("--udp-alt-port", type=int, default=3479, help="alternate UDP port for NAT probes")
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
            type=type(value),
            default=value,
            dest=f"limit_{f.name}",
            metavar="N",
            help=f"{_LIMIT_HELP[f.name]} (default {value:g})",
        )


def main(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from kafila.obs.log import configure_logging, get_logger
    from kafila.rendezvous.limits import Limits
    from kafila.rendezvous.server import RendezvousServer, ServerConfig

    configure_logging(args.log_format or os.environ.get("KAFILA_LOG") or "json")
    if bool(args.cert) != bool(args.key):
        get_logger("kafila.rendezvous").error("tls_config", error="--cert and --key go together")
        return 2
    limits = Limits(**{f.name: getattr(args, f"limit_{f.name}") for f in dataclasses.fields(Limits)})
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
    )
    try:
        asyncio.run(RendezvousServer(config, handle_signals=True).serve_forever())
    except OSError as exc:  # a port in use or not ours to bind: named, no traceback
        log = get_logger("kafila.rendezvous")
        log.error("listen_failed", error=exc.strerror or str(exc), errno=exc.errno)
        return 1
    return 0
