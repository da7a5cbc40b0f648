"""What the session benchmarks share: machine load while they run, requests against a member's
API, trace records from the head, and the single-process baseline (kafila.engine.generate).

Load: the machine has 2 cores shared with other work, so every benchmark prints the load average
and, from /proc, how many cores were busy during the run and how many of those were not ours
(the benchmark process and its fleet): a figure measured while others took a core is not a
figure of an idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kafila.demo.fleet import LocalFleet as LocalFleet  # noqa: E402  (the scripts import it from here)

MODEL = "smollm2-135m"
# A plain continuation rarely ends early, so greedy answers run to max_tokens on every system.
PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"
TICK = os.sysconf("SC_CLK_TCK")


# -- load ------------------------------------------------------------------------------------------


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over every CPU since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (empty if the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _proc_ticks(fields: list[str]) -> int:
    """utime + stime in jiffies (0 if the process is gone). Not the children's: a fleet member is
    watched itself, and its time lands in our cutime when it exits (counted twice)."""
    return sum(int(x) for x in fields[11:13])


def _started_ticks(fields: list[str]) -> int | None:
    """When the process started, in jiffies since boot (None if it is gone)."""
    return int(fields[19]) if len(fields) > 19 else None


def _uptime_ticks() -> int:
    return int(float(Path("/proc/uptime").read_text().split()[0]) * TICK)


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
    return out


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's processor elsewhere) and LLVM's name for
    it, which picks the kernels' settings (few_rows.prefetch_for): sessions run on different
    machines, and a figure is a figure of one of them."""
    name = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), name)
    with contextlib.suppress(ImportError):
        from llvmlite import binding as llvm

        name += f", {llvm.get_host_cpu_name()}"
    return name


class Load:
    """Samples machine CPU use and our own (this process + fleets' processes) between start and stop."""

    def __init__(self) -> None:
        self.cores = len(os.sched_getaffinity(0))
        self.loadavg_start = os.getloadavg()
        self._t0 = time.monotonic()
        self._boot_t0 = _uptime_ticks()
        self._m0 = _machine_ticks()
        self._ours: dict[int, tuple[int, int]] = {}  # pid -> (first, last) ticks seen
        self.watch(os.getpid())

    def watch(self, *pids: int) -> None:
        for root in pids:
            for p in _tree(root):
                fields = _stat(p)  # read once: its CPU so far and when it started
                t, started = _proc_ticks(fields), _started_ticks(fields)
                # a process started while we watch (a fleet's member): all its CPU is ours, its
                # start-up and probe included
                first = 0 if started is not None and started >= self._boot_t0 else t
                self._ours.setdefault(p, (first, t))

    def watch_fleet(self, fleet: LocalFleet) -> None:
        pids = [m.proc.pid for m in fleet.members if m.proc is not None]
        if fleet._rendezvous is not None:
            pids.append(fleet._rendezvous.pid)
        self.watch(*pids)

    def sample(self) -> None:
        """Record our processes' CPU now (call before a fleet closes: a dead process has no figures)."""
        for p, (first, _) in list(self._ours.items()):
            t = _proc_ticks(_stat(p))
            if t:
                self._ours[p] = (first, t)

    def report(self) -> str:
        self.sample()
        busy0, total0 = self._m0
        busy1, total1 = _machine_ticks()
        wall = time.monotonic() - self._t0
        busy_cores = (busy1 - busy0) / max(total1 - total0, 1) * self.cores
        ours = sum(last - first for first, last in self._ours.values()) / TICK / max(wall, 1e-9)
        la0, la1 = self.loadavg_start[0], os.getloadavg()[0]
        return (
            f"load: {self.cores} cores ({cpu_model()}); {busy_cores:.2f} cores busy on average over "
            f"{wall:.0f} s, "
            f"{ours:.2f} of them this benchmark's processes, {max(busy_cores - ours, 0):.2f} others'; "
            f"load average {la0:.2f} at start, {la1:.2f} at end"
        )


# -- requests ----------------------------------------------------------------------------------------


@dataclass
class Answer:
    text: str
    completion_tokens: int
    wall_s: float


def complete(
    url: str,
    max_tokens: int,
    prompt: str = PROMPT,
    timeout: float = 600.0,
    client: httpx.Client | None = None,
) -> Answer:
    """One greedy /v1/completions request (not streamed), through `client` (default: this process's
    own, kept open). A client is made before the clock starts: making one costs 50 ms here (httpx
    builds an SSL context even for http://), and four threads making theirs at once took 136 ms
    under the GIL, so the last of four "simultaneous" requests left 100 ms after the first."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    client = client or _shared_client()
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json=body, timeout=timeout)
    wall = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    doc = r.json()
    return Answer(doc["choices"][0]["text"], int(doc["usage"]["completion_tokens"]), wall)


@functools.cache
def _shared_client() -> httpx.Client:
    return httpx.Client()


def concurrent(
    url: str, users: int, max_tokens: int, prompts: Sequence[str] | None = None
) -> tuple[list[Answer], float]:
    """`users` requests at once (one thread and one HTTP client each, as separate users have);
    returns the answers and the wall time from the first send to the last answer."""
    prompts = prompts or [PROMPT] * users
    answers: list[Answer | BaseException] = [RuntimeError("not run")] * users
    clients = [httpx.Client() for _ in range(users)]

    def one(i: int) -> None:
        try:
            answers[i] = complete(url, max_tokens, prompts[i], client=clients[i])
        except BaseException as exc:  # reported below
            answers[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(users)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    for a in answers:
        if isinstance(a, BaseException):
            raise RuntimeError(f"a concurrent request failed: {a}") from a
    return [a for a in answers if isinstance(a, Answer)], wall


def request_records(fleet: LocalFleet) -> list[dict[str, Any]]:
    """The head's request trace records, oldest first."""
    return [r for r in fleet.traces(fleet.head) if r.get("type") == "request"]


def wait_records(fleet: LocalFleet, n: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The head writes a request's record as it finishes; wait until `n` are on disk."""
    deadline = time.monotonic() + timeout
    while True:
        recs = request_records(fleet)
        if len(recs) >= n or time.monotonic() > deadline:
            return recs
        time.sleep(0.1)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> float:
    return (max(xs) - min(xs)) / 2 if xs else float("nan")


# -- single process ------------------------------------------------------------------------------------


class SingleProcess:
    """The whole model in this process (kafila.engine.generate), as `kafila run` runs it."""

    def __init__(self, backend: str = "auto", dtype: str = "auto", context: int = 2048) -> None:
        from kafila.engine.stage import Stage
        from kafila.engine.tokenizer import Tokenizer
        from kafila.models.checkpoint import Checkpoint
        from kafila.models.registry import resolve

        ckpt = Checkpoint.open(resolve(MODEL))
        self.tokenizer = Tokenizer.from_checkpoint(ckpt)
        n = ckpt.config.num_hidden_layers
        self.stage = Stage.load(ckpt, range(n), True, backend, dtype, context)

    def run(self, max_tokens: int, prompt: str = PROMPT) -> tuple[list[int], float]:
        """Greedy tokens and the decode tokens/s (steps after the first token over their time)."""
        from kafila.engine.generate import Timings, generate
        from kafila.engine.sampler import SamplingParams

        ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        timings = Timings()
        stops = tuple(self.tokenizer.stop_ids)
        out = list(
            generate(self.stage, ids, SamplingParams(max_tokens=max_tokens), eos_ids=stops, timings=timings)
        )
        return out, timings.decode_tps

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(
            [t for t in tokens if t not in self.tokenizer.stop_ids], skip_special_tokens=True
        )


def add_slow_by(p: argparse.ArgumentParser) -> None:
    """The --slow-by flag of the benchmarks whose fleets have CPU shares."""
    p.add_argument(
        "--slow-by",
        default="pace",
        choices=["pace", "quota"],
        help="how a share slows its member: pace (default: one pinned CPU each, every computation "
        "stretched to CPU time / share, kafila.engine.pace) or quota (cgroup v1 cpu quota, root)",
    )


def fleet_banner(fleet: LocalFleet) -> str:
    return fleet.describe() + "\nplans (predicted by the host):\n" + fleet.predicted_table()


# -- several fleets side by side ------------------------------------------------------------------------


def start_fleets(
    stack: contextlib.ExitStack, specs: dict[str, LocalFleet], load: Load
) -> dict[str, LocalFleet]:
    """Start each fleet in turn (its members probe on a machine where the others are idle) and keep
    them all up, so that rounds can alternate between them."""
    for label, fleet in specs.items():
        stack.enter_context(fleet)
        load.watch_fleet(fleet)
        print(f"\n== {label} ==\n{fleet_banner(fleet)}", flush=True)
    return specs


def interleaved_rounds(
    fleets: dict[str, LocalFleet], tokens: int, rounds: int
) -> tuple[dict[str, list[dict[str, Any]]], bool]:
    """One warm-up request per fleet, then `rounds` rounds of one request to each fleet's head in
    turn; returns each fleet's request trace records (warm-up dropped) and whether every answer was
    the same text."""
    texts = set()
    for _ in range(rounds + 1):
        for fleet in fleets.values():
            texts.add(complete(fleet.url(fleet.head), tokens).text)
    records = {label: wait_records(f, rounds + 1)[1:] for label, f in fleets.items()}
    return records, len(texts) == 1


def bottleneck(records: list[dict[str, Any]]) -> tuple[str, float, dict[str, float], dict[str, float]]:
    """(member, ms) of the slowest stage, every stage's median measured ms per decode step, and the
    plan's predicted ms, from request records."""
    members = [s["member"] for s in records[0]["stages"]]
    measured = {
        m: median([s["measured_ms"] for r in records for s in r["stages"] if s["member"] == m])
        for m in members
    }
    predicted = {s["member"]: float(s["predicted_ms"]) for s in records[0]["stages"]}
    slowest = max(measured, key=lambda m: measured[m])
    return slowest, measured[slowest], measured, predicted
