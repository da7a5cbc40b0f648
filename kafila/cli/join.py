"""`kafila join CODE`: join a session with its code (forming, or already serving) and serve as a
member, or wait as a spare."""

from __future__ import annotations

import argparse

from kafila.cli.argtypes import positive_number
from kafila.cli.host import add_member_flags


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("code", help="the session code the host printed, e.g. 4-k7m2-tiger-lamp-ocean")
    parser.add_argument(
        "--wait",
        type=positive_number,
        default=300.0,
        help="seconds to wait for the host's plan, and again for this member's links to come up "
        "(default 300; the weight fetch itself has no limit, it shows its progress; a member the "
        "host keeps as a spare waits for its plan with no limit)",
    )
    add_member_flags(parser)


def main(args: argparse.Namespace) -> int:
    from kafila.cli.host import options, run_member
    from kafila.session.forming.join import join

    return run_member(lambda: join(args.code, options(args)))  # type: ignore[arg-type]
