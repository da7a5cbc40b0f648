"""`probe()`: measure this device with the backend it will infer with, into a ProbeReport.

Figures (each a median and spread over repetitions):
- bandwidth: a reduction streaming a buffer of at least 8x the last-level cache (256 MiB on a CPU,
  1 GiB on a GPU); the paper's b.
- matvec_bandwidth: the same bytes streamed through a decode-shaped matrix-vector product.
- overhead: a tiny op chain that reads ~nothing and ends in a host read, as a decode step pays it.
- flops: an n x n matmul, for the degraded planning tier.
- block (with a model): a stage's decode step through a few (`stage_blocks`) transformer blocks of
  that model's shapes (random weights allocated here, the engine's own model code), per block; each
  call goes through the next of enough such stages to fill twice the last-level cache, so its
  weights come from memory as a ring member's do (a model that fits in the cache: its blocks once).
- head (with a model): the final norm and unembedding of one row, the head's share of a step.
- stage_fixed (with a model): the block figure's stage timed again with twice the blocks and as a
  one-block stage; what does not grow with the blocks (Python and dispatch around the kernels) is
  a stage's per-step part (a least-squares line through the three), and only the rest counts per
  block (without it a 5-block probe folded a fifth of that part into each block).
- wake (with a model): what a stage step costs more after a long idle than after the short gaps
  the figures above are timed with (`fit_wake`): the one-block stage timed after 1, 8 and 32 ms
  of idle (WAKE_GAPS_S), fitted to t(g) = t0 + W (1 - e^(-g/tau)).
  A ring leaves a small stage idle for most of a circuit (one request: everything but its own
  step), and a core that slept that long comes back slower (a VM's halted vCPU, a laptop's
  C-states and clocks): +0.25 ms on a 0.48 ms step after 25 ms idle here (docs/planner.md).
Block and head are timed as a ring runs them: each call follows an idle gap twice its own length
(the other stages of a ring of three computing), so caches, thread wake-ups and a CFS quota's
refill behave as they will in the session.
The other figures loop their workload for a minimum window per repetition; under a cgroup CPU
quota the window spans several CFS periods, so the figure is the share the process actually gets.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kafila.engine import heap, system
from kafila.engine.pace import FULL_SPEED, Pace
from kafila.models.config import ModelConfig
from kafila.obs.log import get_logger
from kafila.planner.cost import IDLE_RATIO, WAKE_FLOOR_S, wake_rise
from kafila.planner.devices import DeviceReport
from kafila.planner.reachability import Nat
from kafila.probe.ops import Ops, Run
from kafila.probe.stats import Figure, rates

log = get_logger("kafila.probe")
FIGURES = (
    "bandwidth",
    "matvec_bandwidth",
    "overhead",
    "flops",
    "block",
    "block_dispatch",
    "head",
    "stage_fixed",
    "wake",
)
WINDOW_S = 0.04  # minimum time per repetition
QUOTA_WINDOW_S = 0.25  # under a CFS quota: at least this long, in whole periods
STAGE_BLOCKS = 5  # blocks of the probe's stage at most (also timed at twice that and at one block)
STEPS = 24  # stage-shaped calls per repetition (with 12: +-15% between probes at a quarter core)
WAKE_GAPS_S = (WAKE_FLOOR_S, 0.008, 0.032)  # the wake figure's idle gaps: short, middle, about a circuit
WAKE_REPEATS = 3  # most repetitions of the wake timings (each about a second at full speed)
WAKE_MAX_STEP_S = 0.01  # no wake figure for a one-block step longer than this
WAKE_TAU_S = (0.0005, 0.032)  # the fitted time constant is kept within these
POSITION = 256  # KV position of the timed decode steps: the planner's costs are a step's at this position


@dataclass(frozen=True)
class ProbeReport:
    backend: str  # e.g. "torch/cpu/fp32"
    threads: int | None
    cpu_quota: float | None
    memory_bytes: int  # available for weights and KV cache, after the reserve
    bandwidth: Figure  # bytes/s
    matvec_bandwidth: Figure  # bytes/s
    overhead: Figure  # s
    flops: Figure  # FLOP/s
    block: Figure | None = None  # s per block per decode step
    block_dispatch: Figure | None = None  # s per block per decode step at tiny shapes (dispatch)
    block_model: str | None = None
    block_bytes: int | None = None
    wall_s: float = 0.0
    head: Figure | None = None  # s per decode step for the final norm and unembedding of one row
    emulated_speed: float = 1.0  # < 1: measured under an emulated pace (kafila.engine.pace)
    stage_fixed: Figure | None = None  # s per stage step that does not grow with its blocks
    wake: Figure | None = None  # s a one-block step costs more after 32 ms idle than after 1 ms
    wake_tau_s: float | None = None  # how fast that cost grows with the idle gap (fit_wake)

    def device_report(
        self, name: str, nat: Nat | None = None, rtt_s: float | None = None, use_block: bool = True
    ) -> DeviceReport:
        return DeviceReport(
            name=name,
            memory_bytes=self.memory_bytes,
            bandwidth_bytes_s=self.bandwidth.median,
            overhead_s=self.overhead.median,
            flops=self.flops.median,
            block_s=self.block.median if (self.block and use_block) else None,
            block_dispatch_s=self.block_dispatch.median if self.block_dispatch else None,
            head_s=self.head.median if (self.head and use_block) else None,
            stage_fixed_s=self.stage_fixed.median if (self.stage_fixed and use_block) else None,
            wake_s=wake_w(self.wake.median, self.wake_tau_s) if self.wake and self.wake_tau_s else None,
            wake_tau_s=self.wake_tau_s if self.wake else None,
            nat=nat,
            rtt_s=rtt_s,
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.__dict__)
        for key in FIGURES:
            d[key] = d[key].to_dict() if d[key] is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeReport:
        figs = {k: Figure.from_dict(d[k]) if d.get(k) else None for k in FIGURES}
        return cls(**{**d, **figs})

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def seconds_per_call(run: Run, repeats: int, window_s: float, pace: Pace = FULL_SPEED) -> list[float]:
    """Warm up once, then per repetition loop `run` for at least `window_s`: seconds per call
    (an emulated pace idles once after each repetition's loop)."""
    run()
    out = []
    for _ in range(repeats):
        calls, began = 0, pace.mark()
        while True:
            run()
            calls += 1
            if time.perf_counter() - began.wall >= window_s:
                break
        out.append(pace.finish(began) / calls)
    return out


def seconds_per_step(
    run: Run,
    repeats: int,
    idle_ratio: float = IDLE_RATIO,
    pace: Pace = FULL_SPEED,
    gap_s: float | None = None,
) -> list[float]:
    """Warm up twice, then time `repeats` x STEPS single calls, each after an idle gap of about
    `idle_ratio` times the previous call (or about `gap_s` seconds where given): seconds per call,
    the median of each repetition. The gaps vary by +-50% (seeded): a fixed gap can lock onto a
    CFS quota's period and measure the same phase every time, where a ring's stages start at every
    phase."""
    jitter = random.Random(0)
    run()
    last = time.perf_counter()
    run()
    last = time.perf_counter() - last
    out = []
    for _ in range(repeats):
        calls = []
        for _ in range(STEPS):
            time.sleep((idle_ratio * last if gap_s is None else gap_s) * jitter.uniform(0.5, 1.5))
            began = pace.mark()
            run()
            last = pace.finish(began)
            calls.append(last)
        out.append(sorted(calls)[len(calls) // 2])
    return out


def _stream_bytes(ops: Ops, memory: int) -> int:
    on_gpu = ops.backend.device != "cpu"
    want = max(8 * (system.llc_bytes() or 32 << 20), (1 << 30) if on_gpu else 256 << 20)
    return int(min(want, max(memory // 8, 16 << 20)))


def probe(
    backend: str = "auto",
    dtype: str = "auto",
    repeats: int | None = None,
    model: ModelConfig | None = None,
    model_name: str | None = None,
    position: int = POSITION,
    stream_bytes: int | None = None,
    pace: Pace = FULL_SPEED,
    quant: str = "none",
) -> ProbeReport:
    """Measure this device. `stream_bytes` overrides the bandwidth buffer (default: 8x the LLC,
    at least 256 MiB on a CPU, 1 GiB on a GPU). `pace` emulates a slower device: every timed
    workload idles after it as the member's stage steps will (kafila.engine.pace). `quant` is the
    session's weight format: the synthetic blocks and head are packed in it and priced as packed."""
    if repeats is not None and repeats < 1:
        raise ValueError(f"probe repeats must be at least 1, got {repeats}")
    if position < 0:
        raise ValueError(f"probe position must be at least 0, got {position}")
    from kafila.engine.backend import resolve
    from kafila.engine.captured import resolve_mode

    be = resolve(backend, dtype)
    t0 = time.perf_counter()  # after the backend import, which the member pays once anyway
    quota = system.cpu_quota()
    threads = _set_threads(be) if be.name == "torch" and be.device == "cpu" else None
    window = quota_window(system.cfs_limit())
    repeats = (3 if quota else 5) if repeats is None else repeats
    ops = Ops(be, quant if be.name == "torch" else "none")
    memory = _memory(ops)
    buf = ops.make_buffer(stream_bytes or _stream_bytes(ops, memory))
    nbytes = ops.nbytes(buf)
    bandwidth = Figure.of(rates(seconds_per_call(ops.make_stream(buf), repeats, window, pace), nbytes), "B/s")
    matvec_bw = Figure.of(rates(seconds_per_call(ops.make_matvec(buf), repeats, window, pace), nbytes), "B/s")
    del buf
    overhead = Figure.of(seconds_per_call(ops.make_dispatch(), repeats, window, pace), "s")
    mm, flop = ops.make_matmul(512 if be.device == "cpu" else 4096)
    flops = Figure.of(rates(seconds_per_call(mm, repeats, window, pace), flop), "FLOP/s")
    block = block_bytes = block_dispatch = head = stage_fixed = wake = None
    wake_tau = None
    if model is not None:
        block, stage_fixed, block_bytes = _stage_blocks(ops, model, position, repeats, pace, memory)
        head_run, _ = ops.make_head(model)
        head = Figure.of(seconds_per_step(head_run, repeats, pace=pace), "s")
        del head_run
        dispatch, dn = ops.make_block_dispatch(model, position)
        block_dispatch = Figure.of([s / dn for s in seconds_per_call(dispatch, repeats, window, pace)], "s")
        wake, wake_tau = _wake(ops, model, position, pace, min(repeats, WAKE_REPEATS))
    heap.trim("probe")  # its synthetic weights' memory, freed, would stay resident beside the stage
    report = ProbeReport(
        backend=str(be),
        threads=threads,
        cpu_quota=quota,
        memory_bytes=memory,
        bandwidth=bandwidth,
        matvec_bandwidth=matvec_bw,
        overhead=overhead,
        flops=flops,
        block=block,
        block_dispatch=block_dispatch,
        block_model=model_name if model is not None else None,
        block_bytes=block_bytes,
        wall_s=time.perf_counter() - t0,
        head=head,
        emulated_speed=pace.speed,
        stage_fixed=stage_fixed,
        wake=wake,
        wake_tau_s=wake_tau,
    )
    log.info(
        "probed",
        backend=report.backend,
        decode=resolve_mode("auto", be),  # the path the block figures timed (kafila.engine.captured)
        bandwidth_gb_s=round(bandwidth.median / 1e9, 2),
        overhead_us=round(overhead.median * 1e6, 1),
        tflops=round(flops.median / 1e12, 4),
        block_ms=round(block.median * 1e3, 3) if block else None,
        block_dispatch_ms=round(block_dispatch.median * 1e3, 3) if block_dispatch else None,
        head_ms=round(head.median * 1e3, 3) if head else None,
        stage_fixed_ms=round(stage_fixed.median * 1e3, 3) if stage_fixed else None,
        wake_ms=round(wake.median * 1e3, 3) if wake else None,
        wake_tau_ms=round(wake_tau * 1e3, 2) if wake_tau else None,
        memory_gb=round(memory / 1e9, 2),
        cpu_quota=quota,
        emulated_speed=pace.speed if pace.emulated else None,
        wall_s=round(report.wall_s, 2),
    )
    return report


def _stage_blocks(
    ops: Ops, model: ModelConfig, position: int, repeats: int, pace: Pace, memory: int
) -> tuple[Figure, Figure | None, int]:
    """(per block, per stage step, bytes of one block): a stage of `stage_blocks` blocks timed
    stage-shaped and, when the second timing's stages fit in a quarter of the memory, timed again
    with twice the blocks and as a one-block stage, split by `fit_fixed`. Each is a `_cold_stage`."""
    llc, nbytes = system.llc_bytes() or 0, ops.block_bytes(model)
    n = stage_blocks(llc, nbytes)
    run, _ = _cold_stage(ops, model, position, n, llc)
    t_n = seconds_per_step(run, repeats, pace=pace)
    del run
    if max(2 * llc, 2 * n * nbytes) > memory // 4:
        return Figure.of([t / n for t in t_n], "s"), None, nbytes
    times = {n: t_n}
    for blocks in (2 * n, 1):
        run, _ = _cold_stage(ops, model, position, blocks, llc)
        times[blocks] = seconds_per_step(run, repeats, pace=pace)
        del run
    fits = [fit_fixed(dict(zip(times, t, strict=True))) for t in zip(*times.values(), strict=True)]
    return Figure.of([per for _, per in fits], "s"), Figure.of([fixed for fixed, _ in fits], "s"), nbytes


def stage_blocks(llc: int, block_bytes: int) -> int:
    """Blocks of the probe's timed stage: STAGE_BLOCKS, or fewer (at least 2) where fewer already
    fill twice the last-level cache, so that a model of large blocks allocates no more than it must."""
    return min(STAGE_BLOCKS, max(2, -(-2 * llc // block_bytes)))


def _cold_stage(ops: Ops, model: ModelConfig, position: int, blocks: int, llc: int) -> tuple[Run, int]:
    """A `blocks`-block stage's decode step, each call through the next of enough distinct such
    stages (at least one) that their weights fill twice the last-level cache `llc`: no call finds
    its weights cached, as in a ring, where a member's stage streams from memory. A short stage
    keeps the probe short on a large cache (300 MB of L3: one stage of 32 blocks took a minute of
    idle gaps). A model whose blocks all fit in the cache stays cached in a ring too: its stages
    hold its blocks once, no more (a 74 KB block needed 1600 copies of a 5-block stage to fill
    600 MB, 18 s to build). Returns (run, stages cycled)."""
    nbytes = ops.block_bytes(model)
    whole = model.num_hidden_layers * nbytes
    cold = whole if whole <= llc else 2 * llc
    copies = max(1, -(-cold // (blocks * nbytes)))
    turn = itertools.cycle([ops.make_block(model, position, blocks) for _ in range(copies)])
    return (lambda: next(turn)()), copies


def fit_fixed(times: dict[int, float]) -> tuple[float, float]:
    """Stage steps of each block count took times[count]: (the per-step part, the per-block part)
    of t = fixed + blocks x per, by least squares weighted by 1 / t^2. Timing noise is a share of
    the time (+-5% of a 19 ms ten-block step is 1 ms, of a 2 ms one-block step 0.1 ms), so each
    point counts by its relative error; unweighted, the long stages' noise moved the line's
    intercept and a one-block stage's prediction was off by twice as much (median 8.4% against
    4.0% at 6% noise, simulated). The one-block stage pins the per-step part directly, where
    2 t_n - t_2n alone amplified the noise of both (0.5-3.6 ms between probes of one half-core
    member). The fixed part is at least 0: timing noise must not make it negative. When more
    blocks did not take longer, nothing is split."""
    xs, ys = list(times), list(times.values())
    ws = [1.0 / (y * y) for y in ys]
    total = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs, strict=True)) / total
    my = sum(w * y for w, y in zip(ws, ys, strict=True)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs, strict=True))
    per = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys, strict=True)) / sxx
    top = max(xs)
    if per <= 0:
        return 0.0, times[top] / top
    fixed = my - per * mx
    if fixed < 0:  # through the origin instead: t = blocks x per
        num = sum(w * x * y for w, x, y in zip(ws, xs, ys, strict=True))
        return 0.0, num / sum(w * x * x for w, x in zip(ws, xs, strict=True))
    return fixed, per


def _wake(
    ops: Ops, model: ModelConfig, position: int, pace: Pace, repeats: int
) -> tuple[Figure | None, float | None]:
    """(rise, tau): the one-block `_cold_stage` timed after each of WAKE_GAPS_S, the three
    interleaved per repetition so that a drift of the machine's speed shifts them alike; rise is
    what a step after the longest gap costs more than after the shortest (a figure over the
    repetitions), tau the `fit_wake` of the three timings' medians. (None, None) where the step is
    longer than WAKE_MAX_STEP_S: the wake-up is lost in it, and the timings would take a minute."""
    run, _ = _cold_stage(ops, model, position, 1, system.llc_bytes() or 0)
    if seconds_per_step(run, 1, pace=pace, gap_s=WAKE_GAPS_S[0])[0] > WAKE_MAX_STEP_S:
        return None, None
    rows = [
        tuple(seconds_per_step(run, 1, pace=pace, gap_s=g)[0] for g in WAKE_GAPS_S) for _ in range(repeats)
    ]
    _, tau = fit_wake(tuple(statistics.median(col) for col in zip(*rows, strict=True)))
    return Figure.of([row[-1] - row[0] for row in rows], "s"), tau


def fit_wake(steps: Sequence[float], gaps: Sequence[float] = WAKE_GAPS_S) -> tuple[float, float]:
    """A stage step took steps[j] after gaps[j] seconds of idle (three gaps, shortest first):
    (W, tau) of t(g) = t0 + W (1 - e^(-g/tau)) through the three, tau kept within WAKE_TAU_S (a
    smaller one: a step that costs the same after any longer gap; a larger one would grow without
    bound past the gaps timed). A step no slower after the longest gap: W = 0."""
    (g0, g1, g2), (t0, t1, t2) = gaps, steps
    rise = t2 - t0
    lo, hi = WAKE_TAU_S
    if rise <= 0:
        return 0.0, hi
    share = (t1 - t0) / rise  # how much of the rise the middle gap already shows

    def shown(tau: float) -> float:  # that share under t(g) with this tau: falls as tau grows
        return wake_rise(g0, g1, tau) / wake_rise(g0, g2, tau)

    for _ in range(60):  # bisection on log tau
        tau = math.sqrt(lo * hi)
        lo, hi = (tau, hi) if shown(tau) > share else (lo, tau)
    tau = math.sqrt(lo * hi)
    return wake_w(rise, tau, gaps), tau


def wake_w(rise: float, tau: float, gaps: Sequence[float] = WAKE_GAPS_S) -> float:
    """W of t(g) = t0 + W (1 - e^(-g/tau)) from the rise between the shortest and longest gap timed."""
    return max(0.0, rise) / wake_rise(gaps[0], gaps[-1], tau)


def quota_window(limit: tuple[float, float] | None) -> float:
    """Seconds per repetition: WINDOW_S, or under a CFS limit (quota, period) the whole number of
    periods that spans QUOTA_WINDOW_S. Any span of whole periods grants exactly its quota whatever
    the phase; a span of 2.5 periods may hold two or three of the process's bursts (+-20% at a
    quarter core)."""
    if limit is None:
        return WINDOW_S
    period = limit[1]
    return period * max(1, math.ceil(QUOTA_WINDOW_S / period - 1e-9))


def memory_now(backend: str) -> int:
    """What a probe under `backend` ("torch/cpu/fp32", as its report names it) would offer for
    weights now: the device's free memory less the reserve, read without timing anything."""
    from kafila.engine.backend import resolve

    name, _, rest = backend.partition("/")
    return _memory(Ops(resolve(name, rest.partition("/")[2] or "auto")))


def _memory(ops: Ops) -> int:
    total = ops.memory_available() or system.system_memory_available() or 0
    return max(0, total - system.reserve(total))


def _set_threads(be: Any) -> int:
    """Size torch's CPU thread pool to `system.usable_cpus()`: the CPUs of our affinity mask, capped
    by a cgroup quota (more threads than the quota only get throttled together). The engine should
    run with the same count, or the probe measures another machine than the one that infers."""
    import torch

    torch.set_num_threads(system.usable_cpus())
    return int(torch.get_num_threads())
