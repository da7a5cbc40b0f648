"""A slow member: tokens/s of a session with one member at 25% of a core, against the ideal.

Two fleets side by side: three unlimited members, and the same three with one limited to 0.25 of a
core (cgroup v1, root). The ideal for the limited fleet is the unlimited rate scaled by the fleet's
remaining capacity: with shares s_i (unlimited = 1 core each) the ring's speed scales with the
sum of per-member speeds, so ideal = rate_unlimited * sum(s_i) / n. Kafila's planner gives the
slow member fewer blocks; the ratio measured / ideal shows how close it gets. Target >= 95%
(llama.cpp's RPC split reaches 78%, shared notes). On 2 shared cores "unlimited" members share
the cores, so the scaling is approximate; the load report says how busy the machine was.

    python3 benchmarks/slow_member.py [--tokens 48] [--rounds 4]
"""

from __future__ import annotations

import argparse
import contextlib

from _session_common import Load, LocalFleet, interleaved_rounds, median, start_fleets


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--rounds", type=int, default=4, help="measured rounds per fleet (default 4)")
    p.add_argument(
        "--slow", type=float, default=0.25, help="the slow member's share of a core (default 0.25)"
    )
    args = p.parse_args()
    load = Load()
    shares = {"unlimited": [None, None, None], "slow": [None, None, args.slow]}
    with contextlib.ExitStack() as stack:
        fleets = start_fleets(stack, {k: LocalFleet(v, context=512) for k, v in shares.items()}, load)
        records, same = interleaved_rounds(fleets, args.tokens, args.rounds)
        load.sample()
    rate = {k: median([r["tokens_per_s"] for r in recs]) for k, recs in records.items()}
    capacity = (2 + args.slow) / 3
    ideal = rate["unlimited"] * capacity
    print(f"\nunlimited      {rate['unlimited']:7.2f} tok/s")
    print(
        f"one at {args.slow:.2f} {rate['slow']:7.2f} tok/s (ideal {ideal:.2f} = unlimited x {capacity:.2f})"
    )
    print(f"measured/ideal {rate['slow'] / ideal:7.0%}   (target >= 95%)   same answers: {same}")
    print(load.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
