"""A member's API under a flood of idle connections, members as separate processes on loopback:
2,000 connections that never send a byte, held against the host while it runs with a descriptor
limit of 1,024 (soft and hard, so raising the soft one at start gains nothing). The ring keeps
serving through the other members, a member killed during the flood is planned around, a keyed
request to the host answers once the connections close, and the host's log stays small."""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from kafila.demo.fleet import FleetMember, LocalFleet

pytestmark = [
    pytest.mark.network,
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the fleet's start alone took 4.5 min here at a load of 10 on 2 cores
]
MODEL = "smollm2-135m"
KEY = "overload-test-key-0123456789"
HEADERS = {"Authorization": f"Bearer {KEY}"}
IDLE = 2000  # connections held against the host
HOST_FDS = 1024  # the host's descriptor limit, soft and hard
LOG_GROWTH_MAX = 100_000  # bytes the host's log may grow by over the whole flood (it grew 184 MB in 40 s)
FLOOD_MAX_S = 180.0  # the connections' thread ends by itself after this long


@dataclass
class IdleConnections:
    """`count` TCP connections to `address` that send nothing, held by a thread of their own: each
    one the server closes is opened again on the next round (every `round_s`), so the server faces
    `count` idle connections all along, until `stop()` or `max_s`."""

    address: tuple[str, int]
    count: int
    round_s: float = 1.0
    max_s: float = FLOOD_MAX_S
    opened: int = 0
    closed_by_server: int = 0
    open_failures: int = 0
    _socks: set[socket.socket] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> IdleConnections:
        self._thread = threading.Thread(target=self._run, name="idle-connections", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            assert not self._thread.is_alive(), "the idle connections' thread did not end"

    def _run(self) -> None:
        sel = selectors.DefaultSelector()  # epoll: more than 1,024 descriptors
        ends = time.monotonic() + self.max_s
        try:
            while not self._stop.is_set() and time.monotonic() < ends:
                self._top_up(sel)
                round_ends = time.monotonic() + self.round_s
                while (left := round_ends - time.monotonic()) > 0 and not self._stop.is_set():
                    for key, _ in sel.select(timeout=min(left, 0.1)):
                        self._reap(sel, key.fileobj)  # type: ignore[arg-type]
        finally:
            for sock in self._socks:
                sock.close()
            self._socks.clear()
            sel.close()

    def _top_up(self, sel: selectors.BaseSelector) -> None:
        while len(self._socks) < self.count:
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            except OSError:
                self.open_failures += 1
                return
            sock.setblocking(False)
            sock.connect_ex(self.address)  # EINPROGRESS or done: either way held from now on
            self._socks.add(sock)
            sel.register(sock, selectors.EVENT_READ)
            self.opened += 1

    def _reap(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        """A readable idle connection is one the server closed (or answered): let it go."""
        sel.unregister(sock)
        sock.close()
        self._socks.discard(sock)
        self.closed_by_server += 1


@contextlib.contextmanager
def descriptors_at_least(wanted: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"this test holds {wanted} descriptors; the hard limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def ask(url: str, content: str = "Say hello.", timeout: float = 60.0) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0}  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=HEADERS, timeout=timeout)


def session_of(member: FleetMember) -> dict[str, object]:
    assert member.api_url is not None
    return dict(httpx.get(f"{member.api_url}/session", headers=HEADERS, timeout=10).json())


def open_descriptors(member: FleetMember) -> int:
    assert member.proc is not None
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{member.proc.pid}/fd"))
    return -1


@pytest.fixture
def fleet(smollm2_path, tmp_path) -> Iterator[LocalFleet]:
    with LocalFleet(
        (None, None, None), MODEL, context=512, workdir=tmp_path, stagger=False,
        extra_args=("--threads", "1"), fd_limits=(HOST_FDS, None, None), api_key=KEY,
    ) as f:  # fmt: skip
        yield f


def test_idle_connections_against_the_host_leave_the_ring_serving_and_a_loss_planned_around(
    fleet: LocalFleet,
) -> None:
    with descriptors_at_least(IDLE + 1024):
        host = fleet.members[0]
        assert host.api_url is not None
        doc = fleet.session()
        assert doc["state"] == "serving" and len(doc["ring"]) == 3
        # the one killed is neither the host (whose loss hands the session over) nor the head
        victim = next(m for m in reversed(fleet.members[1:]) if m.name != doc["head"])
        asker = next(m for m in fleet.members[1:] if m is not victim)
        assert asker.api_url is not None and victim.proc is not None
        assert ask(asker.api_url).status_code == 200
        log_before, fds_before = host.log_path.stat().st_size, open_descriptors(host)
        port = int(host.api_url.rsplit(":", 1)[1])

        flood = IdleConnections(("127.0.0.1", port), IDLE).start()
        try:
            time.sleep(5)  # the flood at full strength before anything is asked
            peak_fds = open_descriptors(host)
            during = ask(asker.api_url, "Name a colour.")
            assert during.status_code == 200, during.text
            victim.proc.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                state = session_of(asker)
                if state["state"] == "serving" and victim.name not in state["ring"]:  # type: ignore[operator]
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(f"no re-plan around {victim.name} within 90 s: {state}")
            after_loss = ask(asker.api_url, "Name a fruit.")
            assert after_loss.status_code == 200, after_loss.text
            peak_fds = max(peak_fds, open_descriptors(host))
            assert host.proc is not None and host.proc.poll() is None, host.log_text()[-3000:]
        finally:
            flood.stop()
        print(
            f"flood: {flood.opened} opened, {flood.closed_by_server} closed by the host, "
            f"{flood.open_failures} could not open; host descriptors at most {peak_fds} of {HOST_FDS}"
        )
        assert flood.opened >= IDLE and flood.open_failures == 0
        deadline = time.monotonic() + 15  # once the host has seen them close
        while open_descriptors(host) > fds_before + 16 and time.monotonic() < deadline:
            time.sleep(0.2)
        answer = ask(host.api_url, "Name an animal.", timeout=30)
        assert answer.status_code == 200, answer.text
        refused = httpx.get(f"{host.api_url}/v1/models", timeout=10)
        assert refused.status_code == 401  # the key is asked for all along
        state = session_of(host)
        # one re-plan, for the member killed: the flood broke the ring nowhere else (starved beats would)
        assert state["state"] == "serving" and state["epoch"] == 2, state
        assert victim.name not in state["ring"], state  # type: ignore[operator]
        growth = host.log_path.stat().st_size - log_before
        assert growth < LOG_GROWTH_MAX, f"the host's log grew {growth} bytes: {host.log_text()[-3000:]}"
