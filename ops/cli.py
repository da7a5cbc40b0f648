"""`kafila-ops`: bring a multi-site fleet up from one file, watch it, benchmark it, take it down.

kafila-ops fleet plan FLEET.toml        divisions, and every command `up` would run (dry run)
kafila-ops fleet up FLEET.toml          check hosts, ship the image, start members, wait serving; on a
                                        fleet that serves: a rolling upgrade of the members whose image
                                        or kafila changed, one at a time (--dry-run: the order only)
kafila-ops fleet status FLEET.toml      containers and services, session state, links (exit 0: every
                                        member runs; 1: a host could not be asked; 3: a member is not
                                        running)
kafila-ops fleet logs FLEET.toml [MEMBER]
kafila-ops fleet traces FLEET.toml DIR  every member's /traces -> Prometheus TSDB blocks in DIR/tsdb
kafila-ops fleet bench FLEET.toml       Table IV through the head's API, one user and four
kafila-ops fleet down FLEET.toml        remove what up started (idempotent; exit 1 naming each host
                                        where removal failed: run it again once they answer)
kafila-ops monitor FLEET.toml           ssh tunnels to every member's metrics + Prometheus file_sd
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ACTIONS = ("plan", "up", "down", "status", "logs", "traces", "bench")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kafila-ops",
        description="Kafila fleets across sites over ssh: containers on Linux hosts (Dockerfile.cuda), "
        "native members through the host's service manager (systemd-run --user, launchd).",
        epilog="ssh runs in batch mode with shared connections: keys or an agent must let it in without "
        "asking. docs/ops.md describes fleet files.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    f = sub.add_parser("fleet", help="plan, up, down, status, logs, traces, bench")
    f.add_argument("action", choices=ACTIONS)
    f.add_argument("fleet", type=Path, help="fleet file (fleets/*.toml)")
    f.add_argument("extra", nargs="?", help="logs: a member (default every one); traces: the output folder")
    f.add_argument("-v", "--verbose", action="store_true", help="print every remote command as it runs")
    f.add_argument(
        "--wait", type=float, default=900.0, help="up: seconds to wait for the code and for serving (900)"
    )
    f.add_argument(
        "--dry-run",
        action="store_true",
        help="up on a serving fleet: print the rolling upgrade's order (or why it is refused), stop nothing",
    )
    f.add_argument("--lines", type=int, default=50, help="logs: lines per member (default 50)")
    f.add_argument(
        "--out", type=Path, help="bench: the file the table is kept in (default bench-FLEET-TIME.txt)"
    )
    f.add_argument("--requests", type=int, default=4, help="bench: rounds per load (default 4)")
    f.add_argument("--max-tokens", type=int, default=32, help="bench: tokens per answer (default 32)")
    m = sub.add_parser(
        "monitor", help="keep ssh tunnels to each member's metrics; write Prometheus file_sd targets"
    )
    m.add_argument("fleet", type=Path)
    m.add_argument(
        "--targets", type=Path,
        help="the file_sd file Prometheus reads (default prometheus/targets/FLEET.json, which "
        "prometheus/prometheus.yml reads when run from the repository root)",
    )  # fmt: skip
    m.add_argument(
        "--listen", default="127.0.0.1", metavar="ADDRESS",
        help="the address of this machine the tunnels listen on and the targets name (default "
        "127.0.0.1, for a Prometheus running here; `docker`: Docker's bridge address, for the "
        "compose monitoring profile's Prometheus)",
    )  # fmt: skip
    m.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    from kafila.planner.fleet import FleetError
    from ops.fleetfile import load
    from ops.remote import OpsError, Remote

    args = parser().parse_args(argv)
    try:
        fleet = load(args.fleet)
    except FleetError as exc:
        print(f"kafila-ops: {exc}", file=sys.stderr)
        return 2
    remote = Remote(fleet, verbose=args.verbose)
    try:
        if args.command == "monitor":
            import signal

            from ops.observe import bridge_address, default_targets, monitor

            listen = bridge_address() if args.listen == "docker" else args.listen
            # SIGTERM ends it as Ctrl-C does: its tunnels' ssh processes end with it
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
            monitor(remote, fleet, args.targets or default_targets(fleet), listen=listen)
            return 0
        return run(args, remote)
    except (OpsError, FleetError) as exc:
        print(f"kafila-ops: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def run(args: argparse.Namespace, remote: object) -> int:
    import time

    from ops import fleetcmds, observe
    from ops.remote import Remote

    assert isinstance(remote, Remote)
    fleet = remote.fleet
    if args.action == "plan":
        print(plan_text(fleet, args.fleet))
        return 0
    if args.action == "up":
        from ops import upgrade

        doc = upgrade.serving(remote, fleet)
        if doc is not None:
            upgrade.roll(remote, fleet, doc, args.wait, args.dry_run)
        elif args.dry_run:
            print(
                f"fleet {fleet.name} does not serve: `up` starts every member\n{plan_text(fleet, args.fleet)}"
            )
        else:
            fleetcmds.up(remote, fleet, args.wait)
    elif args.action == "down":
        try:
            fleetcmds.down(remote, fleet)
        finally:
            remote.close()
    elif args.action == "status":
        return fleetcmds.status_exit(fleetcmds.status(remote, fleet))
    elif args.action == "logs":
        fleetcmds.logs(remote, fleet, args.extra, args.lines)
    elif args.action == "traces":
        if not args.extra:
            print(
                "kafila-ops: fleet traces needs an output folder: kafila-ops fleet traces FLEET.toml DIR",
                file=sys.stderr,
            )
            return 2
        observe.traces(remote, fleet, Path(args.extra))
    elif args.action == "bench":
        out = args.out or Path(f"bench-{fleet.name}-{time.strftime('%Y%m%d-%H%M%S')}.txt")
        observe.bench(remote, fleet, out, args.requests, args.max_tokens)
    return 0


def plan_text(fleet: object, path: Path) -> str:
    """The planner's divisions for the fleet's devices, then every command `up` would run."""
    from kafila.cli.plan import render_table
    from kafila.models.presets import resolve_model
    from kafila.planner import DIVISIONS, plan_all
    from ops.actions import up_steps
    from ops.fleetfile import FleetFile

    assert isinstance(fleet, FleetFile)
    p = fleet.plan
    _config, manifest = resolve_model(p.model, "bf16")
    plans = plan_all(p.devices, manifest, context=p.context, concurrency=p.concurrency, divisions=DIVISIONS)
    lines = [
        render_table(str(path), p.model, manifest.n_blocks, plans),
        "",
        f"fleet {fleet.name}: commands `up` runs, in order:",
    ]
    lines += [f"{i:>3}. {s.describe()}" for i, s in enumerate(up_steps(fleet), 1)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
