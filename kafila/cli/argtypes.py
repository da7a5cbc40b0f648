"""Argparse value types shared by the commands: each refuses what the runtime would choke on later.

argparse's own `int` and `float` take "inf", "nan", negatives and non-ASCII digits; these name the
accepted range instead, in one wording ("must be ..., got '...'").
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """A parser of whole numbers from `low` (to `high`, when given), ASCII digits only."""
    wanted = f"{low}-{high}" if high is not None else f"a whole number >= {low}"

    def parse(text: str) -> int:
        digits = text.isascii() and text.isdigit()
        if not digits or int(text) < low or (high is not None and int(text) > high):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return int(text)

    parse.__name__ = f"whole_number_{low}_{high}"
    return parse


positive_int = whole_number(1)
non_negative_int = whole_number(0)
port_number = whole_number(0, 65535)  # a TCP/UDP port; 0 asks for any free one


def count(text: str) -> int:
    """A context or concurrency: a whole number >= 1 that fits the wire's 32 bits, as in a fleet file."""
    from kafila.planner.fleet import MAX_COUNT  # pure: the standard library only

    value = positive_int(text)
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT}, got {text!r}")
    return value


def positive_number(text: str) -> float:
    """A finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def member_name(text: str) -> str:
    """A name the rendezvous takes: 1-64 characters, none of them control characters."""
    from kafila.proto.signaling import MAX_NAME

    if not 1 <= len(text) <= MAX_NAME or not text.isprintable():
        got = f"{len(text)} characters" if len(text) > MAX_NAME else repr(text)
        raise argparse.ArgumentTypeError(f"must be 1-{MAX_NAME} printable characters, got {got}")
    return text


def rendezvous_url(text: str) -> str:
    """--rendezvous: a ws(s):// or http(s):// URL or HOST[:PORT], as the signaling URL."""
    from kafila.proto.signaling import signal_url

    try:
        return signal_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
