"""Where a decode step's time goes around the ring: compute, hand-offs, QUIC, the wire.

A three-member ring on loopback (as benchmarks/pipeline_overhead.py: no CPU limits), every member
started with KAFILA_HOP_MARKS (kafila.obs.hopmarks): each process writes a timestamp when a
decode step's frame passes a point of its way (the socket read, the decoded message, the hand-off
to the model thread, the compute, the event loop, the encoded message, sendto). All members run on
this machine, so their clocks are one clock and the marks of one step line up across processes.
The script then prints, per segment, the median and 90th percentile over every decode step of the
requests, the sum of the medians by kind (compute, model-thread hand-offs, the event loop's tasks
and queues, message encoding, QUIC sending and receiving, the wire), and next to it a single
process's decode time per token (kafila.engine.generate, same model, dtype and threads), so the
ring's compute can be compared with the same work done in one process. Last, what a token took at
the head from one `sampled` mark to the next (median and mean: the mean carries the tails that the
sum of medians leaves out, and is what tokens/s sees).

    python3 benchmarks/hop_costs.py [--tokens 96] [--requests 3] [--threads N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
from collections import defaultdict
from pathlib import Path

from _session_common import Load, LocalFleet, SingleProcess, complete, fleet_banner, median

from kafila.engine.system import THREADS_ENV
from kafila.obs.hopmarks import ENV

Marks = dict[str, dict[str, int]]  # key "request:position:rows" -> tag -> perf_counter_ns
Segments = dict[tuple[str, str], list[float]]  # (where, kind) -> microseconds, one per decode step

# (first mark, second mark, kind): consecutive marks of one decode step at one process
COMPUTE = [("submit", "start", "hand-off"), ("start", "end", "compute"), ("end", "back", "hand-off")]
SEND = [("back", "send", "loop"), ("send", "encoded", "encode"), ("encoded", "sent", "QUIC send")]
RECEIVE = [("read", "decoded", "QUIC receive"), ("decoded", "submit", "loop")]
HEAD_BACK = [
    ("read", "decoded", "QUIC receive"),
    ("decoded", "l_submit", "loop"),
    ("l_submit", "l_start", "hand-off"),
    ("l_start", "l_end", "compute"),
    ("l_end", "sampled", "sampling"),  # on the model thread, which then runs the lane's next step
]


def read_marks(folder: Path) -> dict[int, Marks]:
    by_pid: dict[int, Marks] = {}
    for f in folder.glob("*.marks"):
        marks: Marks = defaultdict(dict)
        for line in f.read_text().splitlines():
            tag, key, ns = line.split()
            marks[key][tag] = int(ns)
        by_pid[int(f.stem)] = marks
    return by_pid


def ring_order(by_pid: dict[int, Marks], members: int) -> list[Marks]:
    """The head (it samples) first, then the members in the order a step reaches them."""
    heads = [m for m in by_pid.values() if any("sampled" in tags for tags in m.values())]
    if len(heads) != 1 or len(by_pid) != members:
        raise SystemExit(
            f"expected marks of {members} members, one of them the head; found {len(by_pid)} "
            f"files, {len(heads)} with a sampled token (see the members' logs)"
        )
    head = heads[0]
    others = [m for m in by_pid.values() if m is not head]
    keys = [
        k for k, tags in head.items() if "sampled" in tags and all("start" in o.get(k, {}) for o in others)
    ]
    if not keys:
        raise SystemExit("no decode step left marks at every member")
    return [head, *sorted(others, key=lambda m: m[keys[0]]["start"])]


def segments(ring: list[Marks], key: str) -> list[tuple[str, str, float]] | None:
    """(where, kind, microseconds) for every segment of decode step `key`; None if a mark is missing."""
    out: list[tuple[str, str, float]] = []
    try:
        places = [("head", ring[0], [*COMPUTE, *SEND])]
        places += [(f"member {i}", m, [*RECEIVE, *COMPUTE, *SEND]) for i, m in enumerate(ring[1:], 1)]
        places += [("head", ring[0], HEAD_BACK)]
        prev_sent: int | None = None
        for where, marks, segs in places:
            tags = marks[key]
            if prev_sent is not None:
                out.append((f"wire to {where}", "wire", (tags["read"] - prev_sent) / 1e3))
            for a, b, kind in segs:
                out.append((f"{where}: {a} -> {b}", kind, (tags[b] - tags[a]) / 1e3))
            prev_sent = tags.get("sent")
    except KeyError:
        return None
    return out


def next_step(ring: list[Marks], key: str) -> float | None:
    """From the head's sampling of step `key` to its hand-off of the request's next step (us)."""
    rid, pos, rows = key.split(":")
    nxt = ring[0].get(f"{rid}:{int(pos) + 1}:{rows}", {})
    if "submit" not in nxt or "sampled" not in ring[0][key]:
        return None
    return (nxt["submit"] - ring[0][key]["sampled"]) / 1e3


def token_intervals(head: Marks) -> list[float]:
    """Microseconds between a request's consecutive tokens at the head (`sampled` to `sampled`):
    what a token really takes, tails and overlaps included, which the sum of medians is not."""
    by_request: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for key, tags in head.items():
        rid, pos, rows = key.split(":")
        if rows == "1" and "sampled" in tags:
            by_request[rid].append((int(pos), tags["sampled"]))
    out = []
    for marks in by_request.values():
        marks.sort()
        out += [(b - a) / 1e3 for (p, a), (q, b) in itertools.pairwise(marks) if q == p + 1]
    return out


def overlapping(head: Marks) -> dict[str, int]:
    """Per request (its id at the head): how many other requests' marks overlap its own in time."""
    times: dict[str, list[int]] = defaultdict(list)
    for key, tags in head.items():
        times[key.split(":")[0]] += tags.values()
    span = {r: (min(ts), max(ts)) for r, ts in times.items()}
    return {r: sum(c < b and d > a for q, (c, d) in span.items() if q != r) for r, (a, b) in span.items()}


def by_load(ring: list[Marks], min_position: int = 30) -> dict[str, Segments]:
    """Every segment's microseconds per decode step past `min_position` (the prompt's KV cache is
    filled, steps are steady), split by whether its request ran "alone" or beside two or more
    others ("loaded"); ("circuit", "circuit") is the head's submit to sampled."""
    others = overlapping(ring[0])
    out: dict[str, Segments] = {"alone": defaultdict(list), "loaded": defaultdict(list)}
    for key, tags in ring[0].items():
        rid, pos, _ = key.split(":")
        segs = segments(ring, key) if int(pos) >= min_position and "sampled" in tags else None
        if segs is None:
            continue
        split = out["loaded" if others[rid] >= 2 else "alone"]
        for where, kind, us in segs:
            split[(where, kind)].append(us)
        split[("circuit", "circuit")].append((tags["sampled"] - tags["submit"]) / 1e3)
    return out


def report_by_load(split: dict[str, Segments]) -> None:
    """Means in ms, alone against loaded: by kind (summed over the ring), then segment by segment."""
    alone, loaded = split["alone"], split["loaded"]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) / 1e3 if xs else float("nan")

    def kinds(part: Segments) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (_, kind), xs in part.items():
            out[kind] += mean(xs)
        return out

    n_alone, n_loaded = len(alone[("circuit", "circuit")]), len(loaded[("circuit", "circuit")])
    print(f"\nwhere a decode step's time goes, mean ms: {n_alone} steps alone / {n_loaded} with others")
    ka, kl = kinds(alone), kinds(loaded)
    for kind in sorted(ka, key=lambda k: -ka[k]):
        print(f"  {kind:>12} {ka[kind]:7.2f} {kl.get(kind, float('nan')):7.2f}")
    for where, kind in alone:
        if kind != "circuit":
            print(f"  {where:46} {mean(alone[(where, kind)]):7.2f} {mean(loaded[(where, kind)]):7.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=96, help="tokens generated per request (default 96)")
    p.add_argument("--requests", type=int, default=3, help="requests, one after another (default 3)")
    p.add_argument("--members", type=int, default=3, help="members in the ring (default 3)")
    p.add_argument("--threads", type=int, help="compute threads of the members and the single process")
    args = p.parse_args()
    if args.threads:
        os.environ[THREADS_ENV] = str(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="kafila-hop-marks-"))
    os.environ[ENV] = str(folder)  # read by the members when they start

    load = Load()
    single = SingleProcess(context=512)
    with LocalFleet([None] * args.members, context=512) as fleet:
        load.watch_fleet(fleet)
        print(fleet_banner(fleet))
        head = fleet.url(fleet.head)
        complete(head, 8)  # warm-up: the first request is cold
        single.run(8)
        single_rates = []
        for _ in range(args.requests):
            complete(head, args.tokens)
            single_rates.append(single.run(args.tokens)[1])
        load.sample()
    # the members wrote their last marks when they stopped
    print(f"hop marks in {folder}")
    ring = ring_order(read_marks(folder), args.members)
    steps = [k for k, tags in ring[0].items() if k.endswith(":1") and "submit" in tags]
    per_seg: dict[tuple[str, str], list[float]] = defaultdict(list)
    for key in steps:
        for where, kind, us in segments(ring, key) or []:
            per_seg[(where, kind)].append(us)
    gaps = [g for k in steps if (g := next_step(ring, k)) is not None]
    per_seg[("head: sampled -> next submit", "loop")] = gaps
    report(per_seg, len(steps), 1e3 / median(single_rates), args)
    tokens = token_intervals(ring[0])
    if tokens:
        mean = sum(tokens) / len(tokens) / 1e3
        print(
            f"a token at the head, sampled to sampled: median {median(tokens) / 1e3:.2f} ms, mean "
            f"{mean:.2f} ms (ring/single by the mean: {1e3 / median(single_rates) / mean:.3f})"
        )
    print(load.report())
    return 0


def report(
    per_seg: dict[tuple[str, str], list[float]], n: int, single_ms: float, args: argparse.Namespace
) -> None:
    threads = f"{args.threads} thread(s)" if args.threads else "every CPU"
    print(f"\n{n} decode steps of {args.requests} requests x {args.tokens} tokens, {threads}")
    print(f"{'segment':46} {'kind':>12} {'median us':>10} {'p90 us':>9}")
    by_kind: dict[str, float] = defaultdict(float)
    for (where, kind), xs in per_seg.items():
        xs = sorted(xs)
        print(f"{where:46} {kind:>12} {median(xs):10.1f} {xs[int(0.9 * (len(xs) - 1))]:9.1f}")
        by_kind[kind] += median(xs)
    total = sum(by_kind.values())
    print("\nby kind (sum of medians, ms per token):")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:>12} {us / 1e3:7.2f}  ({us / total:5.1%})")
    print(f"  {'ring total':>12} {total / 1e3:7.2f}")
    print(
        f"single process: {single_ms:.2f} ms per token (decode); the ring's compute is "
        f"{by_kind['compute'] / 1e3:.2f} ms, its other work {(total - by_kind['compute']) / 1e3:.2f} ms"
    )


if __name__ == "__main__":
    raise SystemExit(main())
