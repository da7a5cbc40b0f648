"""The NAT lab with WAN edges: the public namespace routes instead of bridging, and every packet
between two public addresses (sites' routers, the rendezvous) passes a user-space router that holds
it for its edge's one-way delay, jitter, loss and rate cap (tests/natlab/wanrouter.py on a TUN
device; this kernel has no netem qdisc). Needs root, like the NAT lab.

    with WanLab() as lab:
        sites = [lab.add_site("permissive") for _ in range(3)]
        lab.shape(Shape(delay=0.020))                       # every edge, 20 ms one way
        lab.shape(Shape(delay=0.020), {("s1", "s2"): Shape(delay=0.040)})  # one direction slower

Nodes are named "rdv" (both rendezvous addresses) and "s<i>" (site i's router). The public
namespace answers ARP for every address (proxy ARP) and holds a /32 route per address, so the
sites keep the NAT lab's addresses and routers unchanged; `ip rule iif <port> lookup 100` sends
each packet that arrives from a site to the TUN device, and what the router writes back is
routed by the main table to the destination's port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.natlab.delayline import Edge, Shape
from tests.natlab.lab import RDV_ADDRS, Lab, Site, sh

TABLE = "100"
TUN = "tun0"
REPO = Path(__file__).resolve().parents[2]


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (a throwaway namespace and veth to try it on)."""
    name = f"kwn{os.getpid()}"
    try:
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "add", "a", "type", "veth", "peer", "name", "b")
        probe = ["tc", "qdisc", "add", "dev", "a", "root", "netem", "delay", "1ms"]
        tried = subprocess.run(["ip", "netns", "exec", name, *probe], capture_output=True, timeout=30)
        return tried.returncode == 0
    except (RuntimeError, FileNotFoundError):
        return False
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@dataclass
class WanLab(Lab):
    """A Lab whose public edges are shaped; `shape()` changes them while packets flow."""

    router: subprocess.Popen[str] | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="wanlab-")))
    default: Shape = field(default_factory=Shape)
    edges: dict[Edge, Shape] = field(default_factory=dict)
    seed: int = 1
    ports: list[str] = field(default_factory=list)  # the public namespace's port to each site
    bypassed: bool = False  # True: packets do not pass the router (`bypass`)

    @property
    def config(self) -> Path:
        return self.workdir / "wan.json"

    def _build_public(self) -> None:
        self._ns(self.inet)
        for key in ("ip_forward=1", "conf.all.rp_filter=0", "conf.default.rp_filter=0"):
            sh("ip", "netns", "exec", self.inet, "sysctl", "-qw", f"net.ipv4.{key}")
        sh("ip", "-n", self.inet, "addr", "add", "198.18.0.254/32", "dev", "lo")  # ARP's source address
        sh("ip", "-n", self.inet, "tuntap", "add", "dev", TUN, "mode", "tun")
        # a deep queue to the router process: a descheduled router must not drop a burst (500 by default)
        sh("ip", "-n", self.inet, "link", "set", TUN, "txqueuelen", "20000", "up")
        self._write_config()
        self._start_router()
        sh("ip", "-n", self.inet, "route", "add", "default", "dev", TUN, "table", TABLE)
        self._ns(self.rdv)
        self._plug(self.rdv, "eth0", "prdv")
        for addr in RDV_ADDRS:
            sh("ip", "-n", self.rdv, "addr", "add", f"{addr}/24", "dev", "eth0")
            sh("ip", "-n", self.inet, "route", "add", f"{addr}/32", "dev", "prdv")

    def _plug(self, ns: str, ifname: str, port: str) -> None:
        """A veth from `ns` into the public router: proxy ARP on its port, and what comes in from
        it goes to the TUN device."""
        sh("ip", "link", "add", ifname, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.inet)
        keys = (f"conf.{port}.proxy_arp=1", f"conf.{port}.rp_filter=0", f"neigh.{port}.proxy_delay=0")
        for key in (f"net.ipv4.{k}" for k in keys):  # proxy_delay: answer ARP now, not up to 0.8 s later
            sh("ip", "netns", "exec", self.inet, "sysctl", "-qw", key)
        sh("ip", "-n", self.inet, "link", "set", port, "up")
        self.ports.append(port)
        if not self.bypassed:
            sh("ip", "-n", self.inet, "rule", "add", "iif", port, "lookup", TABLE)
        sh("ip", "-n", ns, "link", "set", ifname, "up")

    def add_site(self, kind: str) -> Site:
        site = super().add_site(kind)
        sh("ip", "-n", self.inet, "route", "add", f"{site.wan}/32", "dev", f"pr{site.index}")
        self._write_config()
        self._reload()
        return site

    def nodes(self) -> dict[str, str]:
        names = {addr: "rdv" for addr in RDV_ADDRS}
        names.update({s.wan: f"s{s.index}" for s in self.sites})
        return names

    def shape(self, default: Shape, edges: Mapping[Edge, Shape] | None = None) -> None:
        """Every edge gets `default` except those in `edges` ((src node, dst node): one direction);
        packets pass the router again if `bypass` took it out of their way."""
        self.default, self.edges = default, dict(edges or {})
        self._write_config()
        self._reload()
        if self.bypassed:
            for port in self.ports:
                sh("ip", "-n", self.inet, "rule", "add", "iif", port, "lookup", TABLE)
            self.bypassed = False

    def bypass(self) -> None:
        """Take the user-space router out of every packet's way until the next `shape`: the public
        namespace forwards at the kernel's rate (no delay; a session forms and fetches its weights
        faster than through one Python process)."""
        if not self.bypassed:
            for port in self.ports:
                sh("ip", "-n", self.inet, "rule", "del", "iif", port, "lookup", TABLE)
            self.bypassed = True

    def counts(self) -> dict[str, dict[str, int]]:
        """Packets passed, lost and overflowed per edge ("s1->s2") since the router started."""
        out = Path(str(self.config) + ".counts")
        out.unlink(missing_ok=True)
        assert self.router is not None
        self.router.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not out.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the WAN router did not write its counters within 5 s")
            time.sleep(0.01)
        return json.loads(out.read_text())

    def _write_config(self) -> None:
        edges = [{"src": a, "dst": b, **asdict(s)} for (a, b), s in self.edges.items()]
        cfg = {"nodes": self.nodes(), "default": asdict(self.default), "edges": edges, "seed": self.seed}
        tmp = self.config.with_suffix(".tmp")
        tmp.write_text(json.dumps(cfg))
        tmp.replace(self.config)

    def _start_router(self) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        cmd = ["ip", "netns", "exec", self.inet, sys.executable, "-m", "tests.natlab.wanrouter", TUN]
        self.router = subprocess.Popen(
            [*cmd, str(self.config)], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
        )
        assert self.router.stdout is not None
        line = self.router.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the WAN router did not start (exit {self.router.poll()}): {line!r}")

    def _reload(self) -> None:
        if self.router is not None:
            self.router.send_signal(signal.SIGHUP)
            time.sleep(0.05)  # the router reads the file between packets

    def close(self) -> None:
        if self.router is not None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait(5)
            if self.router.stdout is not None:
                self.router.stdout.close()
            self.router = None
        super().close()
