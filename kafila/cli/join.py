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
    import asyncio

    from kafila.cli.host import options, serve_until_interrupted
    from kafila.session.form import SessionError, say
    from kafila.session.start import join

    async def run() -> None:
        formed = await join(args.code, options(args))  # type: ignore[arg-type]
        await serve_until_interrupted(formed)

    try:
        asyncio.run(run())
    except SessionError as exc:
        say(f"error: {exc}")
        return 1
    return 0
