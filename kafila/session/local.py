"""Several members on one machine as separate processes: the demo, the process tests, the benchmarks.

`LocalFleet` starts a rendezvous and N members (`kafila host` + `kafila join`) as child processes,
each member optionally limited to a share of one CPU with the cgroup v1 cpu controller (root only),
so one machine holds honestly unequal members. It waits until every member's API reports the
session as serving, and stops every child (and removes its cgroups) on close.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cgroups_available() -> bool:
    return os.geteuid() == 0 and (CGROUP_CPU / "cgroup.procs").exists()


class CpuLimit:
    """A cgroup v1 cpu group holding one process at `share` of one CPU."""

    def __init__(self, name: str, share: float) -> None:
        self.path = CGROUP_CPU / f"kafila-{name}-{os.getpid()}"
        self.path.mkdir(exist_ok=True)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(int(PERIOD_US * share)))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:  # its processes are still exiting
                time.sleep(0.1)


@dataclass
class Member:
    name: str
    api: str
    proc: subprocess.Popen[bytes]
    share: float | None = None
    limit: CpuLimit | None = None


@dataclass
class LocalFleet:
    model: str = "smollm2-135m"
    shares: tuple[float | None, ...] = (None, None, None)  # CPU share per member (None: unlimited)
    division: str = "kafila"
    context: int = 512
    concurrency: int = 1
    workdir: Path = field(default_factory=lambda: Path("/tmp/kafila-local"))
    extra: tuple[str, ...] = ()  # more flags for every member
    log: Any = None  # file for the children's stderr (default: inherit)
    members: list[Member] = field(default_factory=list)
    rendezvous: subprocess.Popen[bytes] | None = None
    url: str = ""

    def start(self, timeout: float = 600.0) -> LocalFleet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._start_rendezvous()
        code_file = self.workdir / "code"
        code_file.unlink(missing_ok=True)
        names = ["alpha", "beta", "gamma", "delta", "epsilon"][: len(self.shares)]
        host = [
            *("host", "--model", self.model, "--members", str(len(self.shares)), "--division", self.division),
            *("--context", str(self.context), "--concurrency", str(self.concurrency)),
            *("--code-file", str(code_file)),
        ]
        self._member(names[0], 0, host)
        code = self._wait_code(code_file, timeout)
        for i, name in enumerate(names[1:], start=1):
            self._member(name, i, ["join", code])
        self.wait_serving(timeout)
        return self

    def _start_rendezvous(self) -> None:
        port, udp, alt = free_port(), free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
        cmd = [sys.executable, "-m", "kafila", "rendezvous", "--host", "127.0.0.1", "--port", str(port),
               "--udp-port", str(udp), "--udp-alt-port", str(alt)]  # fmt: skip
        self.rendezvous = subprocess.Popen(cmd, stderr=self.log, stdout=subprocess.DEVNULL)
        self.url = f"ws://127.0.0.1:{port}/v1/signal"
        _wait_http(f"http://127.0.0.1:{port}/healthz", 30, self.rendezvous)

    def _member(self, name: str, i: int, args: list[str]) -> None:
        api = f"127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "kafila", *args, "--rendezvous", self.url, "--name", name, "--api", api,
               "--trace", str(self.workdir / f"trace-{name}.jsonl"), *self.extra]  # fmt: skip
        share = self.shares[i]
        limit = CpuLimit(name, share) if share is not None and cgroups_available() else None
        env = {**os.environ, "KAFILA_LOG_LEVEL": os.environ.get("KAFILA_LOG_LEVEL", "warning")}
        proc = subprocess.Popen(cmd, stderr=self.log, stdout=subprocess.DEVNULL, env=env)
        if limit is not None:
            limit.add(proc.pid)
        self.members.append(Member(name, api, proc, share, limit))

    def _wait_code(self, file: Path, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if file.is_file() and file.read_text().strip():
                return file.read_text().strip()
            if self.members[0].proc.poll() is not None:
                raise RuntimeError(f"the host exited with status {self.members[0].proc.returncode}")
            time.sleep(0.1)
        raise TimeoutError(f"the host printed no session code within {timeout:.0f} s")

    def wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for m in self.members:
            _wait_http(f"http://{m.api}/session", max(1.0, deadline - time.monotonic()), m.proc)

    def session(self, member: int = 0) -> dict[str, Any]:
        return httpx.get(f"http://{self.members[member].api}/session", timeout=10).json()  # type: ignore[no-any-return]

    def not_head(self) -> Member:
        head = self.session()["head"]
        return next(m for m in self.members if m.name != head)

    def close(self) -> None:
        for m in self.members:
            if m.proc.poll() is None:
                m.proc.send_signal(signal.SIGINT)
        for p in [m.proc for m in self.members] + ([self.rendezvous] if self.rendezvous else []):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p is not None and p.poll() is None:
                p.terminate()
        if self.rendezvous is not None and self.rendezvous.poll() is None:
            self.rendezvous.terminate()
            self.rendezvous.wait(10)
        for m in self.members:
            if m.limit is not None:
                m.limit.remove()


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(map(str, proc.args[2:5]))} exited with status {proc.returncode}")  # type: ignore[index]
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")
