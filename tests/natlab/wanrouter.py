"""The WAN lab's router: reads every packet the public router namespace forwards from its TUN
device, holds it in a DelayLine for its edge, and writes it back when due (the kernel then routes it
to its site). Runs as its own process inside that namespace:

    python3 -m tests.natlab.wanrouter TUN CONFIG.json

CONFIG: {"nodes": {address: node}, "default": shape, "edges": [{"src": node, "dst": node, ...shape}],
"seed": int}; a shape's keys are the fields of delayline.Shape (seconds, bytes per second). SIGHUP
re-reads the file (held packets keep their release times); SIGUSR1 writes the edge counters to
CONFIG + ".counts" (JSON). Prints "ready" once the TUN device is attached."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from tests.natlab.delayline import DelayLine, Edge, Shape

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
BATCH = 256  # packets read per wake-up at most, so due packets are not starved by a flood


def open_tun(name: str) -> int:
    """Attach to the (persistent) TUN device `name` of this process's namespace; a non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def load(path: Path) -> tuple[dict[str, str], dict[Edge, Shape], Shape, int]:
    cfg: dict[str, Any] = json.loads(path.read_text())
    edges = {(e.pop("src"), e.pop("dst")): Shape(**e) for e in cfg.get("edges", [])}
    return cfg.get("nodes", {}), edges, Shape(**cfg.get("default", {})), int(cfg.get("seed", 0))


def edge_of(packet: bytes, nodes: dict[bytes, str]) -> Edge:
    """The (source node, destination node) of an IPv4 packet; unknown addresses name themselves."""
    src, dst = packet[12:16], packet[16:20]
    return nodes.get(src) or socket.inet_ntoa(src), nodes.get(dst) or socket.inet_ntoa(dst)


class Router:
    def __init__(self, tun: str, config: Path) -> None:
        self.config = config
        names, shapes, default, seed = load(config)
        self.nodes = {socket.inet_aton(a): n for a, n in names.items()}
        self.line = DelayLine(shapes, default, random.Random(seed))
        self.fd = open_tun(tun)

    def reload(self, *_: object) -> None:
        names, shapes, default, _seed = load(self.config)
        self.nodes = {socket.inet_aton(a): n for a, n in names.items()}
        self.line.reshape(shapes, default)

    def dump_counts(self, *_: object) -> None:
        counts = {f"{a}->{b}": vars(self.line.counts((a, b))) for a, b in self.line.edges()}
        tmp = self.config.with_suffix(".counts.tmp")
        tmp.write_text(json.dumps(counts))
        tmp.replace(str(self.config) + ".counts")

    def step(self) -> None:
        due = self.line.next_due()
        timeout = None if due is None else max(0.0, due - time.monotonic())
        readable, _, _ = select.select([self.fd], [], [], timeout)
        if readable:
            now = time.monotonic()
            for _ in range(BATCH):
                try:
                    packet = os.read(self.fd, 65536)
                except BlockingIOError:
                    break
                if len(packet) >= 20 and packet[0] >> 4 == 4:
                    self.line.push(packet, edge_of(packet, self.nodes), now)
        for packet in self.line.release(time.monotonic()):
            with contextlib.suppress(OSError):  # a full kernel queue: lost, as on a real link
                os.write(self.fd, packet)


def main() -> None:
    router = Router(sys.argv[1], Path(sys.argv[2]))
    with contextlib.suppress(OSError):  # a network is not late because its machine is busy
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    signal.signal(signal.SIGHUP, router.reload)
    signal.signal(signal.SIGUSR1, router.dump_counts)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    while True:
        router.step()


if __name__ == "__main__":
    main()
