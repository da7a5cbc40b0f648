"""The flags of a serving command's API limits (kafila.api.overload holds the limits themselves)."""

from __future__ import annotations

import argparse

from kafila.api.overload import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_UNAUTHENTICATED,
    DEFAULT_READ_TIMEOUT_S,
    DESCRIPTOR_RESERVE,
    ApiLimits,
)
from kafila.cli.argtypes import positive_int, positive_number


def add_api_limit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"API connections open at once; one past it is closed at once (default "
        f"{DEFAULT_MAX_CONNECTIONS}, and never more than the descriptor limit leaves room for after "
        f"{DESCRIPTOR_RESERVE} kept for the ring and the weights)",
    )
    parser.add_argument(
        "--api-max-unauthenticated",
        type=positive_int,
        default=DEFAULT_MAX_UNAUTHENTICATED,
        metavar="N",
        help="API connections open at once that have not shown a key yet (without keys: that have "
        "not sent a request's headers); a new one past it closes the oldest such one (default "
        f"{DEFAULT_MAX_UNAUTHENTICATED})",
    )
    parser.add_argument(
        "--api-read-timeout",
        type=positive_number,
        default=DEFAULT_READ_TIMEOUT_S,
        metavar="SECONDS",
        help="a request's headers must arrive within this long of its connection (or of the answer "
        "before it), its body within this long after them; else the connection is closed (default "
        f"{DEFAULT_READ_TIMEOUT_S:g})",
    )


def limits_from_args(args: argparse.Namespace) -> ApiLimits:
    """The API's limits from the flags of `add_api_limit_flags` (ValueError naming a bad one)."""
    return ApiLimits(args.api_max_connections, args.api_max_unauthenticated, args.api_read_timeout)
