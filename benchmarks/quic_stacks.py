"""A hop's protocol work through two QUIC stacks, side by side: aioquic (kafila's) and qh3.

What a ring member pays per hop beyond the single process is mostly QUIC's Python, run from cold
caches after the member waited (docs/benchmarks.md, "What bounds the figures"). qh3 is a fork of
aioquic with the same connection API and its connection core compiled (Rust); this script measures
what moving to such a stack would save, before anyone ports kafila.net.link to it.

Both stacks run contention.py's `HopPair`: two real connections joined in memory (handshake,
TLS 1.3, 16000-byte datagrams), one decode step's hidden row of the default model encoded and
framed by kafila, sent, received and decoded, then the ACK back. Per round and per stack: a hop
back to back (warm), and a hop after a decode step of a 10-block stage and a sleep of --gap-ms
(as a ring member receives after waiting for its turn). Rounds alternate the stacks; medians.

qh3 is not a kafila dependency: `pip install qh3==2.1.0` to run this.

    python3 benchmarks/quic_stacks.py [--rounds 150] [--gap-ms 30]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

from contention import Decoder, HopPair

STACKS = ("aioquic", "qh3")
Hops = dict[tuple[str, str], list[tuple[float, float]]]  # (stack, "warm" | "cold") -> (send, receive) s


def measure(rounds: int, gap_s: float) -> Hops:
    """Each stack's hops warm and cold, the stacks alternated round by round."""
    dec = Decoder(0)
    pairs = {stack: HopPair(stack) for stack in STACKS}
    out: Hops = {(stack, kind): [] for stack in STACKS for kind in ("warm", "cold")}
    for _ in range(rounds):
        for stack, pair in pairs.items():
            pair.hop(dec.row)
            out[(stack, "warm")].append(pair.hop(dec.row))
            dec.step()
            time.sleep(gap_s)
            out[(stack, "cold")].append(pair.hop(dec.row))
    return out


def report(out: Hops, gap_ms: float) -> list[str]:
    us = {key: [statistics.median(x[i] for x in v) * 1e6 for i in (0, 1)] for key, v in out.items()}
    lines = []
    for kind, label in (("warm", "back to back"), ("cold", f"after a step and {gap_ms:.0f} ms")):
        for stack in STACKS:
            send, recv = us[(stack, kind)]
            figures = f"send {send:6.0f} us  receive {recv:6.0f} us  hop {send + recv:6.0f} us"
            lines.append(f"  {stack:<8} {label:<24} {figures}")
        base, other = (sum(us[(s, kind)]) for s in STACKS)
        saved = f"{other / base:.2f} of the time (saves {base - other:.0f} us a hop)"
        lines.append(f"  qh3/aioquic {label}: {saved}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=150, help="rounds, each stack once per round (default 150)")
    p.add_argument("--gap-ms", type=float, default=30.0, help="sleep before each cold hop (default 30)")
    args = p.parse_args()
    if args.rounds < 1 or args.gap_ms <= 0:
        p.error("--rounds must be at least 1, --gap-ms above 0")
    if importlib.util.find_spec("qh3") is None:
        print("qh3 is not installed (not a kafila dependency): pip install qh3==2.1.0", file=sys.stderr)
        return 1
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    versions = ", ".join(f"{s} {importlib.import_module(s).__version__}" for s in STACKS)
    print(f"one hop's protocol work in memory ({versions}), CPU {cpu}, {args.rounds} rounds, medians:")
    print("\n".join(report(measure(args.rounds, args.gap_ms / 1e3), args.gap_ms)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
