"""What one machine does to an emulated fleet: stages that compute at once, and stages that idle.

The session benchmarks run every member on this one machine. Separate machines would not share
what these measure, so their figures say how far a one-machine fleet is from a real one:

1. **Two stages computing at once.** A stage of the default model (10 blocks, fp32, one thread)
   decodes on CPU 0, alone and while a second process decodes another 10-block stage on CPU 1;
   rounds alternate. Both read their weights from the same memory bus and the same L3, so the
   first slows down. In users.py every stage computes at once; in a real fleet each has its
   own memory.
2. **A stage after idling.** The same stage, steps back to back against steps that each follow
   a 30 ms sleep (a ring member idles while the other stages compute; a single process never
   does), alternating. On a VM an idle vCPU is descheduled and its caches go cold.
3. **A hop's protocol work, warm and cold.** One decode step's message through the real code of a
   hop, in memory (no sockets): kafila's tensor encoding and framing, aioquic's packet building
   and encryption on the sender, its decryption and stream reassembly and kafila's decoding on the
   receiver (the ACK back is not timed). Three cases alternate: back to back (warm), right after a
   decode step of the stage (the step streams its weights through the caches, as a ring member's
   does just before it sends), and after a sleep of --gap-ms (as a member that waited for its turn
   receives). This is the Python a ring pays per hop on top of the single process's work.

Each figure is the median step time over the rounds, and the slowdown is measured side by side in
one run.

    python3 benchmarks/contention.py [--rounds 8] [--steps 20] [--gap-ms 30]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.synchronize import Event
from typing import Any

from _session_common import MODEL

BLOCKS = 10


def load_stage(first: int) -> tuple[Any, Any]:
    """A stage of BLOCKS blocks from `first`, one thread, with one request prefilled: (stage, row)."""
    from kafila.engine.system import THREADS_ENV

    os.environ[THREADS_ENV] = "1"  # before torch and numba load
    import torch

    from kafila.engine.stage import Entry, Stage
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.registry import resolve

    ckpt = Checkpoint.open(resolve(MODEL))
    stage = Stage.load(ckpt, range(first, first + BLOCKS), False, context=512)
    stage.open(1)
    prompt = torch.randn(19, ckpt.config.hidden_size)  # [19, H]
    stage.step(prompt, [Entry(1, 0, 19)])
    return stage, prompt[-1:]  # [1, H]


class Decoder:
    """Decode steps of one request on a stage (positions wrap within the context)."""

    def __init__(self, first: int) -> None:
        self.stage, self.row = load_stage(first)
        self.position = 19

    def step(self) -> float:
        from kafila.engine.stage import Entry

        t0 = time.perf_counter()
        self.stage.step(self.row, [Entry(1, self.position, 1)])  # [1, H] -> [1, H]
        self.position = 19 + (self.position - 18) % 400
        return time.perf_counter() - t0


def neighbour(cpu: int, ready: Event, busy: Event, stop: Event) -> None:
    """The second stage: decodes back to back on `cpu` while `busy` is set."""
    os.sched_setaffinity(0, {cpu})
    dec = Decoder(BLOCKS)
    ready.set()
    while not stop.is_set():
        if busy.wait(0.05):
            dec.step()


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def together(
    dec: Decoder, other_cpu: int | None, rounds: int, steps: int
) -> tuple[list[float], list[float]] | None:
    """Step times alone and with the neighbour computing on `other_cpu` (None: no second CPU)."""
    if other_cpu is None:
        return None
    ctx = mp.get_context("spawn")
    ready, busy, stop = ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=neighbour, args=(other_cpu, ready, busy, stop), daemon=True)
    proc.start()
    try:
        if not ready.wait(300):
            raise RuntimeError("the second stage did not load within 300 s")
        alone: list[float] = []
        shared: list[float] = []
        for _ in range(rounds):
            alone += [dec.step() for _ in range(steps)]
            busy.set()
            time.sleep(0.05)  # the neighbour is computing
            shared += [dec.step() for _ in range(steps)]
            busy.clear()
            time.sleep(0.05)
        return alone, shared
    finally:
        stop.set()
        proc.join(10)


def after_idle(dec: Decoder, rounds: int, steps: int, gap_s: float) -> tuple[list[float], list[float]]:
    """Step times back to back and each after a `gap_s` sleep, alternating by round."""
    busy: list[float] = []
    idle: list[float] = []
    for _ in range(rounds):
        busy += [dec.step() for _ in range(steps)]
        for _ in range(steps):
            time.sleep(gap_s)
            idle.append(dec.step())
    return busy, idle


class HopPair:
    """Two QUIC connections joined in memory, carrying kafila messages: what one hop runs.

    `stack` is the QUIC library: "aioquic" (what kafila.net.link drives), or "qh3", an aioquic fork
    with the same connection API and a compiled core (benchmarks/quic_stacks.py compares them)."""

    def __init__(self, stack: str = "aioquic") -> None:
        import importlib
        import ssl

        from kafila.net.certs import make_identity

        configuration = importlib.import_module(f"{stack}.quic.configuration")
        connection = importlib.import_module(f"{stack}.quic.connection")
        self.events = importlib.import_module(f"{stack}.quic.events")
        ident = make_identity()
        cfg = [
            configuration.QuicConfiguration(is_client=c, alpn_protocols=["x"], max_datagram_size=16000)
            for c in (True, False)
        ]
        cfg[0].verify_mode = ssl.CERT_NONE
        if stack == "aioquic":
            cfg[1].certificate, cfg[1].private_key = ident.certificate, ident.private_key
        else:  # qh3 takes PEM only
            cfg[1].load_cert_chain(*_pem(ident))
        self.now, self.addr = 1.0, ("192.0.2.1", 4433)
        self.tx = connection.QuicConnection(configuration=cfg[0])
        self.tx.connect(self.addr, now=self.now)
        self.rx = connection.QuicConnection(
            configuration=cfg[1],
            original_destination_connection_id=self.tx.original_destination_connection_id,
        )
        for _ in range(8):  # the handshake
            self._deliver(self.tx, self.rx)
            self._deliver(self.rx, self.tx)
        while self.tx.next_event() or self.rx.next_event():
            pass

    def _deliver(self, a: Any, b: Any) -> None:
        for data, _ in a.datagrams_to_send(now=self.now):
            b.receive_datagram(data, self.addr, now=self.now)

    def hop(self, row: Any) -> tuple[float, float]:
        """Seconds to send and to receive one decode step's hidden row [1, H]; then the ACK."""
        from kafila.net import framing
        from kafila.proto import tensor as t

        self.now += 0.001
        t0 = time.perf_counter()
        data = row.numpy().tobytes()
        msg = t.encode(t.Hidden(1, t.DType.F32, tuple(row.shape), (t.Entry(1, 19, 1),), data, 0, (5000,)), 1)
        self.tx.send_stream_data(0, framing.encode_header(framing.FIRST_APP_KIND, len(msg)) + msg)
        packets = [d for d, _ in self.tx.datagrams_to_send(now=self.now)]
        t1 = time.perf_counter()
        reader, got = framing.MessageReader(), []
        for d in packets:
            self.rx.receive_datagram(d, self.addr, now=self.now)
        while (ev := self.rx.next_event()) is not None:
            if isinstance(ev, self.events.StreamDataReceived):
                got += [t.decode(m) for _, m in reader.feed(ev.data)]
        t2 = time.perf_counter()
        if len(got) != 1 or not isinstance(got[0], t.Hidden) or got[0].data != data:
            raise RuntimeError("the hop lost or changed its message")
        self.now += 0.03  # the receiver's ACK, due after its delay
        self._deliver(self.rx, self.tx)
        return t1 - t0, t2 - t1


def _pem(ident: Any) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import serialization as ser

    cert = ident.certificate.public_bytes(ser.Encoding.PEM)
    key = ident.private_key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
    return cert, key


def hops(dec: Decoder, rounds: int, steps: int, gap_s: float) -> dict[str, list[tuple[float, float]]]:
    """(send, receive) seconds of a hop: back to back, right after a stage step, after a sleep."""
    pair = HopPair()
    out: dict[str, list[tuple[float, float]]] = {"warm": [], "step": [], "idle": []}
    for _ in range(rounds * steps):
        pair.hop(dec.row)
        out["warm"].append(pair.hop(dec.row))
        dec.step()
        out["step"].append(pair.hop(dec.row))
        time.sleep(gap_s)
        out["idle"].append(pair.hop(dec.row))
    return out


def hop_lines(times: dict[str, list[tuple[float, float]]], gap_ms: float) -> list[str]:
    us = {k: [statistics.median(x[i] for x in v) * 1e6 for i in (0, 1)] for k, v in times.items()}
    warm = us["warm"]
    rows = [
        ("back to back", "warm"),
        ("right after a stage step", "step"),
        (f"after {gap_ms:.0f} ms of sleep", "idle"),
    ]
    return [
        f"  {label:<26} send {us[k][0]:6.0f} us ({us[k][0] / warm[0]:.1f}x)   "
        f"receive {us[k][1]:6.0f} us ({us[k][1] / warm[1]:.1f}x)"
        for label, k in rows
    ]


def line(what: str, base: list[float], other: list[float], labels: tuple[str, str]) -> str:
    b, o = median_ms(base), median_ms(other)
    return f"{what}: {b:.2f} ms {labels[0]}, {o:.2f} ms {labels[1]} ({(o / b - 1) * 100:+.1f}%)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8, help="alternations of each comparison (default 8)")
    p.add_argument("--steps", type=int, default=20, help="decode steps per side per round (default 20)")
    p.add_argument("--gap-ms", type=float, default=30.0, help="idle before each step (default 30)")
    args = p.parse_args()
    if min(args.rounds, args.steps) < 1 or args.gap_ms <= 0:
        p.error("--rounds and --steps must be at least 1, --gap-ms above 0")
    cpus = sorted(os.sched_getaffinity(0))
    cpu, other = cpus[0], (cpus[1] if len(cpus) > 1 else None)
    os.sched_setaffinity(0, {cpu})
    dec = Decoder(0)
    for _ in range(args.steps):  # warm-up
        dec.step()
    print(f"model {MODEL}, fp32, one thread, a stage of {BLOCKS} blocks decoding one request on CPU {cpu}")
    pair = together(dec, other, args.rounds, args.steps)
    if pair is None:
        print("two stages at once: skipped (one CPU)")
    else:
        print(line("two stages at once", *pair, ("alone", "with a second stage computing on another CPU")))
    busy, idle = after_idle(dec, args.rounds, args.steps, args.gap_ms / 1e3)
    print(line("after idling", busy, idle, ("back to back", f"after {args.gap_ms:.0f} ms of sleep")))
    print("a hop's protocol work (encode, frame, aioquic send | aioquic receive, decode), medians:")
    print("\n".join(hop_lines(hops(dec, args.rounds, args.steps, args.gap_ms / 1e3), args.gap_ms)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
