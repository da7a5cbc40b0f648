"""A NAT lab of real Linux netfilter in network namespaces (needs root; importable by benchmarks).

Topology (all addresses are test ranges and never leave the namespaces):

    member host h<i> 10.<i>.0.2 ── lan ── router r<i> ── wan 198.18.0.<10+i> ──┐
                                                                               br0 in "inet"
    rendezvous host "rdv": 198.18.0.2 and 198.18.0.3 (two public addresses) ───┘

Router kinds (netfilter recipes):
- permissive: endpoint-independent mapping and filtering (full cone). MASQUERADE plus an nftables
  dynamic map filled after SNAT (mapped port -> LAN address and port) and used for DNAT.
- ordinary: MASQUERADE (endpoint-independent mapping, port-preserving) with address-and-port
  dependent filtering, WAN input policy drop for new packets (a home router).
- ordinary-address: as permissive, but the DNAT needs the (remote address, mapped port) pair to be in
  a set of contacted pairs: address-dependent filtering (restricted cone).
- restrictive: MASQUERADE fully-random: endpoint-dependent mapping (symmetric NAT).
- ordinary-open: as ordinary, but the router's own stack accepts unsolicited input on its WAN
  address (no WAN input drop, as on a router that answers on its public address or runs no input
  firewall). Not in `KINDS` (the all-pairs tests): see `OPEN_KIND`.

Sockets are created inside a namespace from this process (`Lab.udp_socket`), so one asyncio loop
can drive every member: the socket stays in the namespace it was created in.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Self

CLONE_NEWNET = 0x40000000
SO_RCVBUFFORCE = 33  # Linux; not exported by Python's socket module
RDV_ADDRS = ("198.18.0.2", "198.18.0.3")
KINDS = ("permissive", "ordinary", "ordinary-address", "restrictive")
OPEN_KIND = "ordinary-open"
# The class each router kind must be classified as (the fine-grained kind is kept alongside).
EXPECTED_CLASS = {
    "permissive": "permissive",
    "ordinary": "ordinary",
    "ordinary-address": "ordinary",
    "restrictive": "restrictive",
    OPEN_KIND: "ordinary",
}
_libc = ctypes.CDLL(None, use_errno=True)


def missing_requirements() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "the NAT lab needs root (network namespaces and netfilter)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"the NAT lab needs `{tool}` (apt-get install iproute2 nftables)"
    return None


def sh(*args: str, stdin: str | None = None) -> str:
    out = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns failed: {os.strerror(err)}")


@contextmanager
def netns(name: str) -> Iterator[None]:
    """Run the body (this thread only) inside network namespace `name`."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)


def remove_stale_namespaces() -> None:
    """Delete namespaces of labs whose process is gone (killed before it could clean up)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        owner = name[2:].split("-")[0] if name.startswith("kl") else ""
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@dataclass
class Site:
    """One member behind its own router."""

    index: int
    kind: str
    router: str  # namespace names
    host: str
    wan: str  # public address of the router
    lan: str  # private address of the member host


def _router_rules(kind: str) -> str:
    """The nftables ruleset of one router kind (WAN interface `wan`, LAN interface `lan`)."""
    masq = "masquerade fully-random" if kind == "restrictive" else "masquerade"
    cone = kind in ("permissive", "ordinary-address")
    contacted = " ip saddr . udp dport @contacted" if kind == "ordinary-address" else ""
    dnat = f'iifname "wan" udp dport @portmap{contacted} dnat ip to udp dport map @portmap' if cone else ""
    record = (
        'oifname "wan" ct direction original meta l4proto udp '
        "update @portmap { ct reply proto-dst : ct original ip saddr . ct original proto-src } "
        "update @contacted { ip daddr . ct reply proto-dst }"
        if cone
        else ""
    )
    input_drop = "" if kind == OPEN_KIND else 'iifname "wan" drop'
    return f"""
table ip natlab {{
  map portmap {{
    type inet_service : ipv4_addr . inet_service; flags dynamic,timeout; timeout 120s;
  }}
  set contacted {{
    type ipv4_addr . inet_service; flags dynamic,timeout; timeout 120s;
  }}
  chain pre {{
    type nat hook prerouting priority dstnat; policy accept;
    {dnat}
  }}
  chain post {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "wan" {masq}
  }}
  chain record {{
    type filter hook postrouting priority 110; policy accept;
    {record}
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "wan" ct state established,related accept
    {input_drop}
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "wan" ct state established,related accept
    iifname "wan" ct status dnat accept
    iifname "wan" drop
  }}
  chain block {{
    type filter hook forward priority -10; policy accept;
  }}
}}
"""


@dataclass
class Lab:
    """Namespaces, links and routers; `close()` removes everything (also after a failure)."""

    prefix: str = field(default_factory=lambda: f"kl{os.getpid()}")
    sites: list[Site] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    @property
    def inet(self) -> str:
        return f"{self.prefix}-inet"

    @property
    def rdv(self) -> str:
        return f"{self.prefix}-rdv"

    def __enter__(self) -> Self:
        remove_stale_namespaces()
        try:
            self._build_public()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, name: str) -> str:
        sh("ip", "netns", "add", name)
        self.namespaces.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    def _build_public(self) -> None:
        self._ns(self.inet)
        sh("ip", "-n", self.inet, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.inet, "link", "set", "br0", "up")
        self._ns(self.rdv)
        self._plug(self.rdv, "eth0", "prdv")
        for addr in RDV_ADDRS:
            sh("ip", "-n", self.rdv, "addr", "add", f"{addr}/24", "dev", "eth0")

    def _plug(self, ns: str, ifname: str, port: str) -> None:
        """A veth from `ns` (named `ifname`) into the public bridge (port `port`)."""
        sh("ip", "link", "add", ifname, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.inet)
        sh("ip", "-n", self.inet, "link", "set", port, "master", "br0")
        sh("ip", "-n", self.inet, "link", "set", port, "up")
        sh("ip", "-n", ns, "link", "set", ifname, "up")

    def add_site(self, kind: str) -> Site:
        if kind not in (*KINDS, OPEN_KIND):
            raise ValueError(f"router kind {kind!r} is not one of {(*KINDS, OPEN_KIND)}")
        i = len(self.sites) + 1
        site = Site(
            i, kind, f"{self.prefix}-r{i}", f"{self.prefix}-h{i}", f"198.18.0.{10 + i}", f"10.{i}.0.2"
        )
        self._ns(site.router)
        self._ns(site.host)
        self._plug(site.router, "wan", f"pr{i}")
        sh("ip", "-n", site.router, "addr", "add", f"{site.wan}/24", "dev", "wan")
        sh(
            "ip",
            "link",
            "add",
            "lan",
            "netns",
            site.router,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            site.host,
        )
        sh("ip", "-n", site.router, "addr", "add", f"10.{i}.0.1/24", "dev", "lan")
        sh("ip", "-n", site.router, "link", "set", "lan", "up")
        sh("ip", "-n", site.host, "addr", "add", f"{site.lan}/24", "dev", "eth0")
        sh("ip", "-n", site.host, "link", "set", "eth0", "up")
        sh("ip", "-n", site.host, "route", "add", "default", "via", f"10.{i}.0.1")
        sh("ip", "netns", "exec", site.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        sh("ip", "netns", "exec", site.router, "nft", "-f", "-", stdin=_router_rules(kind))
        self.sites.append(site)
        return site

    def udp_socket(self, ns: str, addr: str = "0.0.0.0", port: int = 0) -> socket.socket:
        """A non-blocking UDP socket bound inside namespace `ns`."""
        with netns(ns):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind((addr, port))
        return sock

    def tcp_listener(self, ns: str, addr: str, port: int = 0) -> socket.socket:
        with netns(ns):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(128)
        sock.setblocking(False)
        return sock

    def block_direct(self, a: Site, b: Site) -> None:
        """Make the direct path between two sites stop answering (both routers drop it)."""
        for site, other in ((a, b), (b, a)):
            sh(
                "ip", "netns", "exec", site.router, "nft", "add", "rule", "ip", "natlab", "block",
                "ip", "saddr", other.wan, "drop",
            )  # fmt: skip
            sh(
                "ip", "netns", "exec", site.router, "nft", "add", "rule", "ip", "natlab", "block",
                "ip", "daddr", other.wan, "drop",
            )  # fmt: skip

    def cut_cable(self, site: Site) -> None:
        """Cut the member host's cable: its router drops every packet to and from it (forwarded
        both ways: its links, direct or relayed, and its rendezvous connection) until `unblock_all`."""
        for way in ("saddr", "daddr"):
            sh("ip", "netns", "exec", site.router, "nft", "add", "rule", "ip", "natlab", "block",
               "ip", way, site.lan, "drop")  # fmt: skip

    def conntrack_udp_timeouts(self, site: Site, unreplied: int, stream: int) -> None:
        """Shorten how long this router remembers UDP flows (Linux: 30 s and 120 s)."""
        for name, value in (
            ("nf_conntrack_udp_timeout", unreplied),
            ("nf_conntrack_udp_timeout_stream", stream),
        ):
            sh("ip", "netns", "exec", site.router, "sysctl", "-qw", f"net.netfilter.{name}={value}")

    def flush_conntrack(self, site: Site) -> None:
        """Make the router forget every flow (as a reboot or a full table would): its NAT mappings
        change on the next packet (a restrictive router picks fresh random ports)."""
        sh("ip", "netns", "exec", site.router, "conntrack", "-F")

    def set_wan_mtu(self, site: Site, mtu: int) -> None:
        """The MTU of the router's public link (1420: as through a WireGuard tunnel)."""
        sh("ip", "-n", site.router, "link", "set", "wan", "mtu", str(mtu))

    def unblock_all(self) -> None:
        for site in self.sites:
            sh("ip", "netns", "exec", site.router, "nft", "flush", "chain", "ip", "natlab", "block")

    def capture(self, port: str = "prdv") -> socket.socket:
        """A raw packet socket on one port of the public bridge (default: the rendezvous's), seeing
        every frame that crosses it in either direction."""
        with netns(self.inet):
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        try:
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 * 1024 * 1024)
            sock.bind((port, 0))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        return sock

    def close(self) -> None:
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self.namespaces.clear()
