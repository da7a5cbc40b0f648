"""`kafila` member processes in the NAT lab's namespaces: start them, wait for what their logs say,
form a session of one member per site, stop them (tests and benchmarks share these)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kafila.rendezvous.server import RendezvousServer
from tests.natlab.lab import Site

API = "127.0.0.1:11434"  # each member's API, inside its own namespace
NAMES = ("alpha", "beta", "gamma", "delta")


def spawn(ns: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "kafila", *args]
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)


async def wait_for(
    check: Callable[[], bool], timeout: float, what: str, procs: Sequence[subprocess.Popen[bytes]]
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: {list(p.args)[3]!s} exited with {p.returncode}")  # type: ignore[arg-type]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        await asyncio.sleep(0.3)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)  # (SIGINT is ignored under a background shell)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


async def form(
    sites: list[Site],
    rdv: RendezvousServer,
    tmp_path: Path,
    procs: list[subprocess.Popen[bytes]],
    ready_s: float = 300.0,
    member_args: Sequence[str] = (),
) -> list[Path]:
    """A session of one member per site (the host first, `NAMES`), every one a `kafila` process in
    its site's namespace, formed and ready; returns their logs. `procs` gets each process as it
    starts, so the caller's `finally: stop(procs)` ends them whatever happens here. `ready_s`: how
    long the session may take to be ready once every member started; `member_args`: more flags for
    every member, the host too (e.g. --draft, which the head follows wherever the plan puts it)."""
    names = NAMES[: len(sites)]
    logs = [tmp_path / f"{n}.log" for n in names]
    code_file = tmp_path / "code"
    common = ["--rendezvous", rdv.url, "--api", API]
    host = ["host", "--members", str(len(sites)), "--name", names[0], "--context", "512", "--code-file"]
    procs.append(spawn(sites[0].host, [*host, str(code_file), *common, *member_args], logs[0]))
    await wait_for(code_file.exists, 120, "session code", procs)
    for site, name, log in zip(sites[1:], names[1:], logs[1:], strict=True):
        join = ["join", code_file.read_text().strip(), "--name", name, *common, *member_args]
        procs.append(spawn(site.host, join, log))
    await wait_for(lambda: "session ready" in logs[0].read_text(), ready_s, "session ready", procs)
    return logs
