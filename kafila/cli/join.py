"""`kafila join CODE`: join a session with its code and serve as a member."""

from __future__ import annotations

import argparse

from kafila.cli.host import add_member_flags


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("code", help="the session code the host printed, e.g. 4-k7m2-tiger-lamp-ocean")
    parser.add_argument(
        "--wait", type=float, default=300.0, help="seconds to wait for the host's plan (default 300)"
    )
    add_member_flags(parser)


def main(args: argparse.Namespace) -> int:
    from kafila.cli.host import options, run_member
    from kafila.session.start import join

    return run_member(lambda: join(args.code, options(args)))  # type: ignore[arg-type]
