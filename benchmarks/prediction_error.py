"""Prediction error: the planner's predicted compute per decode step of each stage against the
time each stage measured, median |predicted - measured| / measured over stages and requests.

Three member processes limited to 1 : 0.5 : 0.25 of a core (cgroup v1, root; without root the
shares are not applied and the run says so), the default model, the kafila division. Each
request's trace record holds every stage's predicted ms (from the plan, i.e. from the members'
probes through the cost model) and its measured median ms per decode step. Target: median
error <= 10% (the paper: 18% over 165 stages).

    python3 benchmarks/prediction_error.py [--tokens 48] [--requests 6]
"""

from __future__ import annotations

import argparse

from _session_common import Load, LocalFleet, complete, fleet_banner, median, wait_records


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--requests", type=int, default=6, help="measured requests (default 6; one more is cold)")
    p.add_argument("--shares", default="1,0.5,0.25", help="CPU shares of the members (default 1,0.5,0.25)")
    args = p.parse_args()
    shares = [float(s) for s in args.shares.split(",")]
    load = Load()
    with LocalFleet(shares, context=512) as fleet:
        load.watch_fleet(fleet)
        print(fleet_banner(fleet))
        for _ in range(args.requests + 1):
            complete(fleet.url(fleet.head), args.tokens)
        records = wait_records(fleet, args.requests + 1)[1:]
        load.sample()
    print(f"\n{'member':<8} {'blocks':<9} {'predicted ms':>12} {'measured ms':>12} {'error':>7}")
    errors = []
    for s in records[0]["stages"]:
        measured = median(
            [x["measured_ms"] for r in records for x in r["stages"] if x["member"] == s["member"]]
        )
        err = abs(s["predicted_ms"] - measured) / measured
        print(f"{s['member']:<8} {s['blocks']!s:<9} {s['predicted_ms']:>12.2f} {measured:>12.2f} {err:>7.0%}")
    for r in records:
        errors += [
            abs(x["predicted_ms"] - x["measured_ms"]) / x["measured_ms"]
            for x in r["stages"]
            if x["measured_ms"]
        ]
    print(
        f"\nmedian |pred - meas| / meas, {len(errors)} stage-requests: {median(errors):.0%} (target <= 10%)"
    )
    print(load.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
