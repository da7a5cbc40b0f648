"""`kafila trace summarize FILE`: the paper's Table IV columns from a session's trace lines."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    s = sub.add_parser(
        "summarize", help="print bottleneck, imbalance, utilisation, tokens/s, prediction error"
    )
    s.add_argument("file", type=Path, help="JSON lines written by a member (kafila host/join --trace FILE)")
    s.add_argument("--json", action="store_true", help="print the summaries as JSON instead of a table")
    s.add_argument(
        "--keep-cold",
        action="store_true",
        help="count each session's first request too (by default it is dropped as cold, as in the paper)",
    )


def main(args: argparse.Namespace) -> int:
    from kafila.obs.trace import format_table, read_lines, summarize

    try:
        with args.file.open() as f:
            summaries = summarize(read_lines(f), drop_cold=not args.keep_cold)
    except (OSError, ValueError) as exc:
        print(f"kafila trace: {args.file}: {exc}", file=sys.stderr)
        return 1
    if not summaries:
        print(
            f"kafila trace: {args.file} holds no finished request with more than one token", file=sys.stderr
        )
        return 1
    if args.json:
        print(json.dumps([asdict(s) for s in summaries], indent=2))
    else:
        print(format_table(summaries))
    return 0
