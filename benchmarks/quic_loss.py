"""One ring edge's QUIC under loss, in virtual time: two real aioquic connections whose datagrams
cross a simulated edge (tests/net/simulated_edge.py: a one-way delay, order-keeping jitter,
Bernoulli loss; no sockets, no clock), the client sending a decode step's activation every circuit
and, after the decode steps, one prefill message. `--formed-ms`: the edge formed on a path of that
delay and served one request there before the path took `--delay-ms` and the loss, as a session
formed in the WAN lab before its edges were shaped. The receiver acknowledges a step when its
stage's output would have left (`--hold` after it arrived), as a ring stage does (kafila.net.link,
"ACKs"). Per congestion control and with or without the link's copies of small flights
(kafila.net.link.copies), over `--seeds` seeds of the loss:

- step ms: the activation's send -> its last byte received (median, 95th and 99th percentile, max);
- window: the congestion window in packets when each step left (median, smallest);
- prefill ms: the (last) prefill message's send -> its last byte received; `--rounds R` makes R
  requests of `--steps` decode steps and a prefill each, as a session serving one user does.

    python3 benchmarks/quic_loss.py [--loss 0.01] [--delay-ms 20] [--jitter-ms 0] [--steps 400]
                                    [--seeds 10] [--rounds 1] [--formed-ms 0.1]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kafila.net import congestion
from kafila.net.link import LinkConfig
from tests.net.simulated_edge import Setup, connect

IDLE_S = 20.0  # after the request at --formed-ms: the lab's shaping changes between requests


def one_run(setup: Setup, seed: int, rounds: int, formed: float | None) -> dict[str, float]:
    """`rounds` requests, each its decode steps, then the next one's prefill; its last prefill's time.
    `formed`: the edge formed and served one request at this one-way delay with no loss first."""
    if formed is None:
        edge = connect(setup, seed)
    else:
        edge = connect(dataclasses.replace(setup, delay=formed, loss=0.0, jitter=0.0), seed)
        edge.decode(setup.steps)
        edge.send(setup.prefill_bytes)
        edge.run_until(edge.now + IDLE_S)
        edge.setup = setup
    steps, windows = [], []
    for _ in range(rounds):
        for _ in range(setup.steps):
            steps += edge.decode(1)
            windows.append(edge.client._loss.congestion_window / setup.mss)
        prefill = edge.send(setup.prefill_bytes)
    steps.sort()
    ms = [1000 * s for s in steps]
    return {
        "step p50": statistics.median(ms),
        "step p95": ms[int(0.95 * len(ms))],
        "step p99": ms[int(0.99 * len(ms))],
        "step max": ms[-1],
        "window median": statistics.median(windows),
        "window least": min(windows),
        "prefill ms": 1000 * prefill,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--jitter-ms", type=float, default=0.0, help="up to this much more per packet, in order")
    p.add_argument("--steps", type=int, default=400, help="decode steps before the prefill")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1, help="requests: each its decode steps, then a prefill")
    p.add_argument("--step-bytes", type=int, default=2330, help="one activation (576 float32 and the header)")
    p.add_argument("--prefill-bytes", type=int, default=350_000, help="a 150-token prompt's activations")
    p.add_argument("--circuit-ms", type=float, default=110.0, help="one decode step's time around the ring")
    p.add_argument("--hold-ms", type=float, default=10.0, help="the stage's compute before its ACK")
    p.add_argument("--mss", type=int, default=1452)
    p.add_argument(
        "--formed-ms",
        type=float,
        help="the edge forms and serves one request at this one-way delay with no loss, idles "
        f"{IDLE_S:g} s, then runs at --delay-ms (a session formed before its path was shaped)",
    )
    args = p.parse_args()
    print(f"benchmarks/quic_loss.py {' '.join(sys.argv[1:])}")
    print(
        "| congestion control | copies | step ms p50 / p95 / p99 / max | window median / least | prefill ms |"
    )
    print("|---|---|---|---|---|")
    for cc in ("reno", "cubic", congestion.NAME):
        for copy_flight in (0, LinkConfig().copy_flight):
            setup = Setup(
                args.loss, args.delay_ms / 1000, args.jitter_ms / 1000, args.mss, cc, copy_flight,
                args.steps, args.step_bytes, args.circuit_ms / 1000, args.hold_ms / 1000, args.prefill_bytes,
            )  # fmt: skip
            formed = None if args.formed_ms is None else args.formed_ms / 1000
            runs = [one_run(setup, seed, args.rounds, formed) for seed in range(1, args.seeds + 1)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            low = {k: min(r[k] for r in runs) for k in runs[0]}
            high = {k: max(r[k] for r in runs) for k in runs[0]}
            copied = "yes" if copy_flight else "no"
            print(
                f"| {cc} | {copied} | {med['step p50']:.0f} / {med['step p95']:.0f} / "
                f"{med['step p99']:.0f} / {med['step max']:.0f} | {med['window median']:.0f} / "
                f"{med['window least']:.0f} | {med['prefill ms']:.0f} ({low['prefill ms']:.0f}-"
                f"{high['prefill ms']:.0f}) |"
            )


if __name__ == "__main__":
    main()
