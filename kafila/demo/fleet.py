"""A fleet of member processes on this one machine, made unequal on purpose by CPU shares.

    LocalFleet([1.0, 0.5, 0.25]) -> start(): `kafila rendezvous` (own process, free ports) ->
        `kafila host` (member 0) -> `kafila join CODE` (the others), each a real CLI process,
        each slowed to its share (below) -> wait for every member's API and for /session to say
        "serving" -> plan, API URLs, session document -> close(): SIGTERM to every member, then
        the rendezvous (SIGTERM/SIGKILL after a grace period), cgroups removed.

How a share slows a member (`slow_by`):
- "pace" (default): the member computes on one thread, pinned to one CPU where `taskset` exists,
  with `--emulate-speed SHARE`: every computation of its model idles until it has taken its CPU
  time / SHARE (kafila.engine.pace), in its probe and in its ring stage alike.
- "quota": the member runs inside its own cgroup v1 `cpu` group (cfs_quota_us = share x
  cfs_period_us, so a share of 0.25 is a quarter of one core, granted every 4 ms: see PERIOD_US).
  Needs root and a writable /sys/fs/cgroup/cpu; without them the fleet still runs but
  `shares_applied` is False and `shares_note` says so (`require_shares=True` refuses instead).
Each process writes its stderr (progress lines and logs) to `workdir/NAME.log`; members write
traces to `workdir/NAME.trace.jsonl`. By default members probe one after another (`stagger`), so
one member's probe does not measure the others' probes on a shared machine.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafila.demo import memory_groups
from kafila.engine import PREFILL_CHUNK
from kafila.obs.log import get_logger
from kafila.proto.signaling import SIGNAL_PATH

# children run the installed (or PYTHONPATH's) kafila: -P keeps the current directory off sys.path,
# so a folder named kafila where `kafila demo` was started (the clone's parent) cannot shadow it
_PYTHON = (sys.executable, "-P")

log = get_logger("kafila.demo.fleet")

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
# A short CFS period: the kernel grants the quota per period, and a member of a ring computes in
# bursts (one stage step, tens of ms) between idle waits. With the usual 100 ms period a 0.25 share
# runs such a burst at full speed and is slowed only on average; with 4 ms it is slow at every
# moment, like a slower device (checked: a 35 ms burst took 87 ms at 1000/4000 us, 35 ms at
# 25000/100000 us). The kernel's smallest quota is 1 ms, so shares under 0.25 lengthen the period.
PERIOD_US = 4_000
MIN_QUOTA_US = 1_000
# CFS weight of a member's group (an ordinary process weighs 1024): on a machine shared with other
# work a quota is only a cap, and a "1.0 core" member got about half a core (probe: 3.8 GB/s, 9.0
# GB/s with this weight; 0.5 and 0.25 shares then measure 4.2 and 2.5). With it a share is also
# what the member gets, while the other work keeps the cores the fleet's shares leave.
WEIGHT = 10_240
GROUP_PREFIX = "kafila-fleet-"
_SERIALS = itertools.count()
DEFAULT_NAMES = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")

_CODE = re.compile(r"kafila: session code: (\S+)")
_API = re.compile(r"kafila: API at (http://\S+)")
_READY = re.compile(r"kafila: session ready")
_HOST_PROBED = re.compile(r"kafila: (waiting for \d+ member|a session of one member)")
_JOIN_PROBED = re.compile(r"kafila: waiting for the host's plan")
_PLANS = re.compile(r"kafila: plans for this session \(predicted\):\n((?:(?!kafila:|\d{4}-\d\d-\d\dT).*\n)+)")


class FleetError(RuntimeError):
    """The fleet could not start, or one of its processes exited: `what` names the process and what
    went wrong, `log` is that process's log file (None when no one process is to blame), `cause`
    its last error line (or its last line); the message adds the end of the log."""

    def __init__(self, what: str, log: Path | None = None) -> None:
        text = _read(log) if log is not None else ""
        super().__init__(f"{what}; its log {log} ends: {_tail(text)}" if text.strip() else what)
        self.what, self.log, self.cause = what, log, _cause(text)


@dataclass
class FleetMember:
    name: str
    share: float | None  # fraction of one core (None: unlimited)
    role: str  # "host" or "join"
    log_path: Path
    trace_path: Path
    proc: subprocess.Popen[bytes] | None = None
    cgroup: Path | None = None
    api_url: str | None = None
    memory_group: Path | None = None  # its cgroup v1 memory group, where the fleet caps its memory
    memory_peak: int | None = None  # that group's peak use (bytes), read as the fleet closes
    oom_kills: int = 0  # the kernel's OOM kills in that group, read as the fleet closes

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


@dataclass
class LocalFleet:
    """`shares[i]` is member i's CPU share in cores (None: unlimited); member 0 hosts."""

    shares: Sequence[float | None]
    model: str = "smollm2-135m"
    division: str = "kafila"
    context: int = 2048
    concurrency: int = 1
    chunk: int = PREFILL_CHUNK
    backend: str = "auto"
    dtype: str = "auto"
    quant: str = "auto"  # the session's weight format (kafila host --quant)
    names: Sequence[str] | None = None
    api_ports: Sequence[int] | None = None  # default: a free port each (read from the member's output)
    workdir: Path | None = None  # default: a new temporary folder, kept for its logs
    wait_s: float = 300.0
    stagger: bool = True  # members probe one after another
    require_shares: bool = False
    # how shares slow a member: "pace" pins it to one CPU and runs it with --emulate-speed SHARE (a
    # deterministic duty cycle per computation, see kafila.engine.pace; no root needed); "quota"
    # puts it in a cgroup v1 cpu group with cfs_quota_us = SHARE x period (needs root)
    slow_by: str = "pace"
    extra_args: Sequence[str] = ()  # more flags for every member (e.g. "--dead-after", "10")
    member_args: Sequence[Sequence[str]] | None = None  # more flags per member (e.g. "--memory-gb", "2")
    # more environment per member (e.g. its own KAFILA_CACHE, so it fetches its weights from the host)
    member_env: Sequence[dict[str, str]] | None = None
    # a descriptor limit per member (soft and hard both, as `ulimit -n N` in a shell; None: this
    # process's own), so a member runs with the 1,024 most machines give a user's processes
    fd_limits: Sequence[int | None] | None = None
    api_key: str | None = None  # every member's API key (KAFILA_API_KEY), sent on the fleet's own requests
    # a memory cap per member in bytes (None: uncapped), each its own cgroup v1 memory group
    # (kafila.demo.memory_groups; root): the member's memory budget, and its peak is read back
    memory_limits: Sequence[int | None] | None = None
    members: list[FleetMember] = field(default_factory=list, init=False)
    rendezvous_url: str | None = field(default=None, init=False)
    code: str | None = field(default=None, init=False)
    shares_applied: bool = field(default=False, init=False)
    shares_note: str = field(default="", init=False)
    # pace: the CPU each member runs on (None: not pinned, no taskset here)
    cpus: dict[str, int | None] = field(default_factory=dict, init=False)
    _rendezvous: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _rdv_log: Path | None = field(default=None, init=False)
    _rdv_cmd: list[str] | None = field(default=None, init=False)
    _rdv_starts: int = field(default=0, init=False)
    _closed: bool = field(default=False, init=False)
    _sigterm: Any = field(default=None, init=False)  # SIGTERM's handler before start(), if it changed
    _serial: int = field(default_factory=lambda: next(_SERIALS), init=False)  # several fleets in one process

    # -- public -----------------------------------------------------------------------------------

    def start(self) -> LocalFleet:
        """Start everything and return once every member serves; on any failure (or Ctrl-C)
        everything started so far is stopped before the error propagates."""
        if len(self.shares) < 1:
            raise ValueError("a fleet needs at least one member")
        atexit.register(self.close)
        self._sigterm = _sigterm_exits()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop members (SIGTERM: they close links and API), then the rendezvous; remove cgroups.
        Not SIGINT: a process started in the background by a shell ignores it, and so do the
        members it starts (they were killed after the grace period, their links never closed)."""
        if self._closed:
            return
        self._closed = True
        with _interrupts_ignored():  # a second Ctrl-C or kill must not leave a member or cgroup behind
            procs = [m.proc for m in self.members if m.proc is not None]
            _stop(procs, signal.SIGTERM, grace_s=8.0)
            if self._rendezvous is not None:
                _stop([self._rendezvous], signal.SIGTERM, grace_s=5.0)
            for m in self.members:
                if m.cgroup is not None:
                    _remove_cgroup(m.cgroup)
                if m.memory_group is not None:
                    self._close_memory_group(m)
        atexit.unregister(self.close)
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
        log.info("fleet_closed", members=len(self.members), workdir=str(self.workdir))

    def __enter__(self) -> LocalFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def memory_peaks(self) -> dict[str, int]:
        """Each memory-capped member's peak use so far (bytes; page cache charged to it included)."""
        out = {}
        for m in self.members:
            if m.memory_group is not None and m.memory_group.exists():
                m.memory_peak = memory_groups.peak_bytes(m.memory_group)
            if m.memory_peak is not None:
                out[m.name] = m.memory_peak
        return out

    def _close_memory_group(self, m: FleetMember) -> None:
        assert m.memory_group is not None
        with contextlib.suppress(OSError):
            m.memory_peak = memory_groups.peak_bytes(m.memory_group)
            m.oom_kills = memory_groups.oom_kills(m.memory_group)
        with contextlib.suppress(OSError):
            memory_groups.remove_group(m.memory_group)
        m.memory_group = None

    def add_member(self, name: str, args: Sequence[str] = (), wait_s: float | None = None) -> FleetMember:
        """One more `kafila join` with the fleet's code into the serving session: a member that
        was lost coming back under its name (its entry, whose process has ended, is replaced; the
        new log is NAME.N.log) or a new one. Returns once its API address is printed (it serves,
        or waits as a spare, as the host decides)."""
        assert self.code is not None and self.workdir is not None
        old = next((i for i, m in enumerate(self.members) if m.name == name), None)
        if old is not None and (proc := self.members[old].proc) is not None and proc.poll() is None:
            raise FleetError(f"member {name} still runs (pid {proc.pid})")
        n = sum(m.log_path.name.startswith(f"{name}.") for m in self.members) + 1
        suffix = "" if old is None else f".{n}"
        member = FleetMember(
            name,
            None,
            "join",
            self.workdir / f"{name}{suffix}.log",
            self.workdir / f"{name}{suffix}.trace.jsonl",
        )
        if old is None:
            self.members.append(member)
        else:
            self.members[old] = member
        self._launch(member, -1, list(args))
        deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
        member.api_url = self._wait_for(member, _API, deadline).group(1)
        return member

    @property
    def api_urls(self) -> dict[str, str]:
        return {m.name: m.api_url for m in self.members if m.api_url}

    def session(self, name: str | None = None) -> dict[str, Any]:
        """The /session document of member `name` (default: the host)."""
        return _get_json(f"{self.api_urls[name or self.members[0].name]}/session", self.api_key)

    @property
    def plan(self) -> dict[str, Any]:
        """The plan summary the session runs (`kafila plan --json` entry, from the host's /session)."""
        return dict(self.session()["plan"]["chosen"])

    @property
    def head(self) -> str:
        return str(self.session()["head"])

    def url(self, name: str) -> str:
        return self.api_urls[name]

    def not_head(self) -> str:
        """A member that is not the head (the head itself in a fleet of one)."""
        head = self.head
        return next((m.name for m in self.members if m.name != head), head)

    def predicted_table(self) -> str:
        """The host's printed plans: the chosen division next to uniform and memory-proportional."""
        found = _PLANS.search(self.members[0].log_text())
        return found.group(1).rstrip("\n") if found else ""

    def traces(self, name: str | None = None) -> list[dict[str, Any]]:
        """Trace records (JSON lines) member `name` wrote (default: every member's, concatenated)."""
        out: list[dict[str, Any]] = []
        for m in self.members:
            if name in (None, m.name) and m.trace_path.exists():
                out += [json.loads(line) for line in m.trace_path.read_text().splitlines() if line.strip()]
        return out

    def describe(self) -> str:
        rows = [f"rendezvous {self.rendezvous_url}   session code {self.code}   logs in {self.workdir}"]
        for m in self.members:
            share = f"cpu {m.share:.2f} core" if m.share is not None else "cpu unlimited"
            if m.name in self.cpus:
                cpu = self.cpus[m.name]
                share = f"speed {m.share:.2f} " + (f"on CPU {cpu}" if cpu is not None else "on one thread")
            applied = "" if m.share is None or self.shares_applied else " (NOT applied)"
            pid = m.proc.pid if m.proc else "-"
            rows.append(f"  {m.name:<8} {m.role:<4} {share}{applied}  pid {pid}  {m.api_url}")
        if self.shares_note:
            rows.append(self.shares_note)
        return "\n".join(rows)

    # -- steps ---------------------------------------------------------------------------------------

    def _start(self) -> None:
        names = self._names()
        if len(names) != len(self.shares):
            raise ValueError(f"{len(self.shares)} shares but {len(names)} names")
        self.workdir = Path(self.workdir or tempfile.mkdtemp(prefix="kafila-fleet-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._check_shares()
        deadline = time.monotonic() + self.wait_s
        self._warm_kernels()
        self._start_rendezvous()
        for i, (name, share) in enumerate(zip(names, self.shares, strict=True)):
            member = FleetMember(
                name,
                share,
                "host" if i == 0 else "join",
                self.workdir / f"{name}.log",
                self.workdir / f"{name}.trace.jsonl",
            )
            self.members.append(member)
            self._launch(member, i)
            if i == 0:
                self.code = self._wait_for(member, _CODE, deadline).group(1)
            if self.stagger and len(self.shares) > 1:
                self._wait_for(member, _HOST_PROBED if i == 0 else _JOIN_PROBED, deadline)
        for m in self.members:
            m.api_url = self._wait_for(m, _API, deadline).group(1)
        if len(self.members) > 1:
            self._wait_for(self.members[0], _READY, deadline)
        self._wait_serving(deadline)
        log.info("fleet_ready", members=len(self.members), code=self.code, shares_applied=self.shares_applied)

    def _names(self) -> list[str]:
        return list(self.names or DEFAULT_NAMES[: len(self.shares)])

    def _pin_cpus(self) -> None:
        """Pace: every member with a share computes on one thread (--threads 1) and, where Linux's
        `taskset` is there, on one CPU of its own: the busiest shares first, each onto the CPU
        whose shares sum least. A share is the fraction of that CPU's speed the member emulates."""
        big = [s for s in self.shares if s is not None and s > 1.0]
        if big:
            raise ValueError(f"with slow_by='pace' a share is a fraction of one CPU, at most 1 (got {big})")
        names = self._names()
        can_pin = hasattr(os, "sched_getaffinity") and shutil.which("taskset") is not None
        load = dict.fromkeys(sorted(os.sched_getaffinity(0)) if can_pin else [], 0.0)
        for name, share in sorted(zip(names, self.shares, strict=True), key=lambda x: -(x[1] or 0.0)):
            if share is not None:
                cpu = min(load, key=lambda c: (load[c], c)) if load else None
                if cpu is not None:
                    load[cpu] += share
                self.cpus[name] = cpu
        self.shares_applied = True
        where = (
            "each on one CPU (" + ", ".join(f"{n} on CPU {c}" for n, c in self.cpus.items()) + ")"
            if can_pin
            else "each on one thread (no taskset here to pin them)"
        )
        self.shares_note = (
            f"CPU shares emulated: members run {where} and idle after every computation of their "
            "model so they run at their share of one CPU's speed (--emulate-speed)"
        )

    def _warm_kernels(self) -> None:
        """Compile the CPU decode kernels once (or load numba's disk cache) before the members
        start, so that they load them instead of all compiling at once on the same cores."""
        if self.backend == "mlx" or importlib.util.find_spec("numba") is None:
            return
        code = "from kafila.models.torch import decode_cpu; decode_cpu.warm_up()"
        start = time.monotonic()
        argv = [*_PYTHON, "-c", code]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=self.wait_s)
        if done.returncode != 0:  # the members will compile for themselves
            log.warning("kernel_warm_up_failed", rc=done.returncode, stderr=done.stderr[-500:])
        else:
            log.info("kernels_ready", seconds=round(time.monotonic() - start, 1))

    def _check_shares(self) -> None:
        if all(s is None for s in self.shares):
            return
        bad = [s for s in self.shares if s is not None and s <= 0]
        if bad:
            raise ValueError(f"CPU shares must be positive (got {bad})")
        if self.slow_by == "pace":
            self._pin_cpus()
            return
        if self.slow_by != "quota":
            raise ValueError(f"slow_by must be 'pace' or 'quota', got {self.slow_by!r}")
        why = cgroup_unavailable()
        if why is None:
            self.shares_applied = True
            _remove_stale_groups()
            total = sum(s or 0.0 for s in self.shares)
            cores = len(os.sched_getaffinity(0))
            self.shares_note = f"CPU shares applied with cgroup v1 cpu quotas: {total:.2f} of {cores} cores"
            return
        self.shares_note = f"CPU shares NOT applied ({why}): every member runs unlimited"
        if self.require_shares:
            raise FleetError(self.shares_note)
        print(f"kafila: {self.shares_note}", file=sys.stderr, flush=True)

    def stop_rendezvous(self, how: int = signal.SIGKILL) -> None:
        """Stop the rendezvous process (SIGKILL: it crashed; SIGTERM: a clean restart); members go on."""
        if self._rendezvous is not None:
            _stop([self._rendezvous], how, grace_s=5.0)

    def restart_rendezvous(self) -> None:
        """Start the rendezvous again on the same ports with the same kept secret (a restart); its
        log goes to rendezvous.N.log."""
        self.stop_rendezvous(signal.SIGTERM)  # a no-op once it was stopped
        self._start_rendezvous()

    def _start_rendezvous(self) -> None:
        assert self.workdir is not None
        starts = self._rdv_starts = self._rdv_starts + 1
        self._rdv_log = self.workdir / ("rendezvous.log" if starts == 1 else f"rendezvous.{starts}.log")
        if self._rdv_cmd is None:  # ports chosen once, so a restart comes back where members look
            port, udp = free_port(), free_port(socket.SOCK_DGRAM)
            alt = next(p for p in iter(lambda: free_port(socket.SOCK_DGRAM), None) if p != udp)
            key = self.workdir / "rendezvous.key"  # its kept secret: sessions and relay channels
            cmd = [*_PYTHON, "-m", "kafila", "rendezvous", "--host", "127.0.0.1", "--port", str(port)]
            cmd += ["--udp-port", str(udp), "--udp-alt-port", str(alt), "--log-format", "json"]
            self._rdv_cmd = [*cmd, "--relay-secret-file", str(key)]
        cmd = self._rdv_cmd
        port = int(cmd[cmd.index("--port") + 1])
        self._rendezvous = _spawn(cmd, self._rdv_log)
        # ready once it answers its health check: whatever its log level lets it write
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            if _healthy(f"http://127.0.0.1:{port}/healthz"):
                self.rendezvous_url = f"ws://127.0.0.1:{port}{SIGNAL_PATH}"
                return
            if self._rendezvous.poll() is not None:
                break
            time.sleep(0.1)
        raise FleetError("kafila rendezvous did not start", self._rdv_log)

    def _launch(self, m: FleetMember, index: int, more: Sequence[str] | None = None) -> None:
        """Start member `m`, the fleet's member `index` (-1: one added later, with `more` flags)."""
        assert self.rendezvous_url is not None and self.workdir is not None
        port = self.api_ports[index] if self.api_ports and index >= 0 else 0
        common = ["--rendezvous", self.rendezvous_url, "--name", m.name, "--api", f"127.0.0.1:{port}"]
        common += ["--backend", self.backend, "--trace", str(m.trace_path)]
        common += ["--wait", str(int(self.wait_s)), *self.extra_args]
        if more is not None:
            common += list(more)
        elif self.member_args:
            common += list(self.member_args[index])
        if m.role == "host":
            cmd = [
                "host",
                "--model",
                self.model,
                "--members",
                str(len(self.shares)),
                "--context",
                str(self.context),
            ]
            cmd += [
                "--concurrency",
                str(self.concurrency),
                "--division",
                self.division,
                "--chunk",
                str(self.chunk),
                "--dtype",  # the session's: the members take it from the host
                self.dtype,
                "--quant",
                self.quant,
            ]
        else:
            assert self.code is not None
            cmd = ["join", self.code]
        argv = [*_PYTHON, "-m", "kafila", *cmd, *common]
        if m.name in self.cpus:
            assert m.share is not None
            cpu = self.cpus[m.name]
            pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
            argv = [*pin, *argv, "--threads", "1", "--emulate-speed", f"{m.share:g}"]
        elif m.share is not None and self.shares_applied:
            m.cgroup = make_cgroup(f"{GROUP_PREFIX}{os.getpid()}-{self._serial}-{m.name}", m.share)
            argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(m.cgroup), *argv]
        limit = self.memory_limits[index] if self.memory_limits and index >= 0 else None
        if limit is not None:
            m.memory_group = memory_groups.make_group(limit, m.name)
            argv = memory_groups.inside(m.memory_group, argv)
        env = self.member_env[index] if self.member_env and index >= 0 else None
        if self.api_key is not None:
            env = {**(env or {}), "KAFILA_API_KEY": self.api_key}
        fds = self.fd_limits[index] if self.fd_limits and index >= 0 else None
        m.proc = _spawn(argv, m.log_path, env, fds)
        log.info("fleet_member_started", member=m.name, role=m.role, pid=m.proc.pid, share=m.share)

    def _wait_for(self, m: FleetMember, pattern: re.Pattern[str], deadline: float) -> re.Match[str]:
        while True:
            found = pattern.search(m.log_text())
            if found:
                return found
            self.check_alive()
            if time.monotonic() > deadline:
                raise FleetError(
                    f"member {m.name}: no '{pattern.pattern}' within {self.wait_s:.0f} s", m.log_path
                )
            time.sleep(0.1)

    def check_alive(self) -> None:
        """FleetError naming the first member (or the rendezvous) that has exited, if any."""
        for m in self.members:
            if m.proc is not None and m.proc.poll() is not None:
                raise FleetError(f"member {m.name} ({m.role}) exited with {m.proc.returncode}", m.log_path)
        if self._rendezvous is not None and self._rendezvous.poll() is not None:
            raise FleetError(f"the rendezvous exited with {self._rendezvous.returncode}", self._rdv_log)

    def _wait_serving(self, deadline: float) -> None:
        for m in self.members:
            while True:
                self.check_alive()
                with contextlib.suppress(OSError, ValueError):
                    doc = _get_json(f"{m.api_url}/session", self.api_key)
                    if doc.get("state") == "serving" and len(doc.get("ring", ())) == len(self.members):
                        break
                if time.monotonic() > deadline:
                    raise FleetError(
                        f"member {m.name}: /session did not say serving within {self.wait_s:.0f} s",
                        m.log_path,
                    )
                time.sleep(0.2)


# -- cgroups ----------------------------------------------------------------------------------------


def cgroup_unavailable() -> str | None:
    """Why CPU shares cannot be applied here, or None when they can."""
    if os.geteuid() != 0:
        return "not root: cgroup v1 cpu quotas need root"
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU}"
    if not os.access(CGROUP_CPU, os.W_OK):
        return f"{CGROUP_CPU} is not writable"
    return None


def quota_for(share: float, period_us: int = PERIOD_US) -> tuple[int, int]:
    """(cfs_period_us, cfs_quota_us) granting `share` cores: quota = share x period, the period
    lengthened where the quota would fall under the kernel's 1 ms minimum."""
    period = max(period_us, math.ceil(MIN_QUOTA_US / share))
    return period, max(MIN_QUOTA_US, round(share * period))


def make_cgroup(name: str, share: float, period_us: int = PERIOD_US) -> Path:
    """A cpu cgroup granting `share` cores (see `quota_for`), weighted WEIGHT."""
    group = CGROUP_CPU / name
    group.mkdir(exist_ok=True)
    period, quota = quota_for(share, period_us)
    (group / "cpu.cfs_quota_us").write_text("-1")  # a period below the current quota is refused
    (group / "cpu.cfs_period_us").write_text(str(period))
    (group / "cpu.cfs_quota_us").write_text(str(quota))
    (group / "cpu.shares").write_text(str(WEIGHT))
    return group


def _remove_cgroup(group: Path) -> None:
    for _ in range(50):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # tasks still inside (a child that outlived its parent): move them out
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (group.parent / "cgroup.procs").write_text(pid)
            time.sleep(0.1)
    log.warning("cgroup_not_removed", group=str(group))


def _remove_stale_groups() -> None:
    """Groups of fleets whose process died without closing."""
    for group in CGROUP_CPU.glob(f"{GROUP_PREFIX}*"):
        pid = group.name[len(GROUP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove_cgroup(group)


# -- processes --------------------------------------------------------------------------------------


def _sigterm_exits() -> Any:
    """Make SIGTERM (`kill`, `timeout`, a service manager) raise SystemExit in the main thread, so
    the owner unwinds and stops its fleet, as on Ctrl-C; by default it would die at once and leave
    the members running (they are in their own process sessions). Returns the handler to put back,
    or None when nothing changed (not the main thread, or SIGTERM already has a handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def exit_on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, exit_on_term)


@contextlib.contextmanager
def _interrupts_ignored() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM in this process for the duration (main thread only; elsewhere a
    no-op). Stopping is bounded by the grace periods (SIGKILL after them), so nothing can hang here."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _spawn(
    argv: list[str], log_path: Path, more: dict[str, str] | None = None, fds: int | None = None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(more or {})}
    env.pop("KAFILA_LOG", None)  # members print progress for people; the rendezvous asks for json itself
    with log_path.open("wb") as out:
        # own session: a Ctrl-C at the terminal reaches the fleet's owner, who stops members in order
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=None if fds is None else functools.partial(_limit_descriptors, fds),
        )


def _limit_descriptors(limit: int) -> None:
    """In the child before it runs the member: at most `limit` descriptors, soft and hard."""
    import resource  # Unix only, as preexec_fn

    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def _stop(procs: list[subprocess.Popen[bytes]], sig: int, grace_s: float) -> None:
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)
    deadline = time.monotonic() + grace_s
    for p in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
    for p in live:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port free on 127.0.0.1 now, TCP (SOCK_STREAM) or UDP (SOCK_DGRAM), for a child that must be
    found there (the rendezvous's signaling port, its probe and relay ports; the benchmarks' servers)."""
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _get_json(url: str, key: str | None = None) -> dict[str, Any]:
    import httpx

    r = httpx.get(url, timeout=5.0, headers={"Authorization": f"Bearer {key}"} if key else None)
    r.raise_for_status()
    return dict(r.json())


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _cause(log: str) -> str:
    """A failed process's last `kafila: error: ...` line (members say their cause so), else the
    last line of its log."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return next(
        (line for line in reversed(lines) if line.startswith("kafila: error:")), lines[-1] if lines else ""
    )
