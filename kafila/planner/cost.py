"""The cost model of Section V-A and the block limits, per device and tier.

Stage cost (full tier):  c_i = o_i + n_i * beta_block / b_i + [i = head] * beta_head_read / b_i
- beta_block: bytes one block's weights occupy; a batch-one decode step reads each weight once.
  When the probe timed the block's op chain at tiny shapes (block_dispatch_s, d_i), a block costs
  d_i + beta_block / b_i: dispatching a block's ~25 ops costs as much as streaming a small block.
  When the synthetic-block probe timed a block of this model on device i, that time replaces
  both (use_block_probe=False keeps the bandwidth form).
- beta_head_read: bytes a token reads at the head (unembedding, final norm, one embedding row).
  When the probe timed this model's final norm and unembedding on device i (head_s), that time
  replaces beta_head_read / b_i in the same way. When it also timed the synthetic stage at two
  block counts, the part that does not grow with the blocks (stage_fixed_s) replaces o_i.
Wake-up (predictions only): a stage left idle for g seconds between steps pays
wake_cost_s(W_i, tau_i, g) - wake_cost_s(W_i, tau_i, IDLE_RATIO c_i) more than c_i, the probe's
figures having been timed after about IDLE_RATIO times the step (kafila.probe.measure). The
division itself is chosen on c_i; the plan's stage times, circuit and figures include the wake-up
at the gaps the division leaves (kafila.planner.decide).
Capacity uses resident bytes: each block holds its weights plus the KV cache reserved for the
session's declared context and concurrency; the head also holds embedding and unembedding.

Throughput tier: per(i) = 2 * params_per_block / flops_i, fixed(i) = o_i if measured else 0, and
no head term (arithmetic throughput does not price the head's extra read).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from kafila.models.manifest import DTYPE_BYTES, Manifest
from kafila.planner.devices import DeviceReport

WAKE_FLOOR_S = 0.001  # the shortest idle gap the probe's wake figure times; shorter ones count as it
IDLE_RATIO = 2.0  # the probe times stage steps each after an idle gap of about this times the step


def wake_rise(g0: float, g: float, tau: float) -> float:
    """(1 - e^(-g/tau)) - (1 - e^(-g0/tau)): how much of W a step after g idle pays over one after g0."""
    return math.exp(-g0 / tau) - math.exp(-g / tau)


def wake_cost_s(w: float, tau: float, gap_s: float) -> float:
    """What a step after `gap_s` seconds of idle costs more than one after WAKE_FLOOR_S under the
    probe's fit t(g) = t0 + W (1 - e^(-g/tau)) (kafila.probe.measure.fit_wake)."""
    return w * wake_rise(WAKE_FLOOR_S, max(gap_s, WAKE_FLOOR_S), tau)


class Tier(StrEnum):
    FULL = "full"  # bandwidth (and overhead) measured on every member
    THROUGHPUT = "throughput"  # only arithmetic throughput on every member
    WORKING_SET = "working_set"  # nothing measured: proportional to memory


@dataclass(frozen=True)
class Workload:
    """The model's byte sizes at the session's declared context and concurrency."""

    n_blocks: int
    block_read_bytes: float  # mean weight bytes of one block (what a token reads)
    block_resident_bytes: int  # largest block's weights plus its KV reservation
    head_read_bytes: int
    head_resident_bytes: int
    params_per_block: float
    context: int
    concurrency: int
    kv_position_bytes: int  # one block's KV cache for one position of one request

    @classmethod
    def of(cls, manifest: Manifest, context: int, concurrency: int) -> Workload:
        if context < 1 or concurrency < 1:
            raise ValueError(f"context {context} and concurrency {concurrency} must be >= 1")
        k = manifest.n_blocks
        mean_block = sum(manifest.block_bytes) / k
        return cls(
            n_blocks=k,
            block_read_bytes=mean_block,
            block_resident_bytes=manifest.block_bytes_max + manifest.kv_bytes(context, concurrency, 1),
            head_read_bytes=manifest.head_read_bytes,
            head_resident_bytes=manifest.head_resident_bytes,
            params_per_block=mean_block / DTYPE_BYTES[manifest.dtype],
            context=context,
            concurrency=concurrency,
            kv_position_bytes=manifest.kv_bytes_per_token_per_block,
        )

    def at(self, context: int, concurrency: int) -> Workload:
        """The same model at another declared context and concurrency."""
        kv = self.kv_position_bytes
        weights = self.block_resident_bytes - kv * self.context * self.concurrency
        resident = weights + kv * context * concurrency
        return replace(self, block_resident_bytes=resident, context=context, concurrency=concurrency)

    def resident_bytes(self, n: int, head: bool) -> int:
        return n * self.block_resident_bytes + (self.head_resident_bytes if head else 0)

    def limit(self, memory_bytes: int, head: bool) -> int:
        """lim(i): most blocks a device holds; smaller on the head."""
        room = memory_bytes - (self.head_resident_bytes if head else 0)
        return max(0, room // self.block_resident_bytes)


@dataclass(frozen=True)
class DeviceCost:
    """fixed(i), per(i) and lim(i) of Algorithm 1 for one device (head and non-head)."""

    name: str
    overhead_s: float
    per_block_s: float
    head_s: float  # extra cost when this device holds the head (0 in the throughput tier)
    limit: int
    limit_head: int
    wake_s: float = 0.0  # W of the probe's wake-up fit (0: none measured)
    wake_tau_s: float = 1.0

    def wake_extra_s(self, stage_s: float, gap_s: float) -> float:
        """What a stage step of `stage_s` (as probed) costs more after `gap_s` idle, at least 0."""
        if not self.wake_s:
            return 0.0
        timed = wake_cost_s(self.wake_s, self.wake_tau_s, IDLE_RATIO * stage_s)
        return max(0.0, wake_cost_s(self.wake_s, self.wake_tau_s, gap_s) - timed)

    def fixed(self, head: bool) -> float:
        return self.overhead_s + (self.head_s if head else 0.0)

    def lim(self, head: bool) -> int:
        return self.limit_head if head else self.limit

    def stage_s(self, n: int, head: bool) -> float:
        return self.fixed(head) + n * self.per_block_s


def choose_tier(devices: Sequence[DeviceReport]) -> Tier:
    if all(d.bandwidth_bytes_s for d in devices):
        return Tier.FULL
    if all(d.flops for d in devices):
        return Tier.THROUGHPUT
    return Tier.WORKING_SET


def device_cost(d: DeviceReport, w: Workload, tier: Tier, use_block_probe: bool = True) -> DeviceCost:
    cost = _device_cost(d, w, tier, use_block_probe)
    if d.wake_s is None or d.wake_tau_s is None:
        return cost
    return replace(cost, wake_s=d.wake_s, wake_tau_s=d.wake_tau_s)


def _device_cost(d: DeviceReport, w: Workload, tier: Tier, use_block_probe: bool) -> DeviceCost:
    lim, lim_head = w.limit(d.memory_bytes, False), w.limit(d.memory_bytes, True)
    overhead = d.overhead_s or 0.0
    if tier is Tier.FULL:
        assert d.bandwidth_bytes_s
        b = d.bandwidth_bytes_s
        per = w.block_read_bytes / b + (d.block_dispatch_s or 0.0)
        head = w.head_read_bytes / b
        if use_block_probe and d.block_s:
            per = d.block_s
            if d.stage_fixed_s is not None:  # measured with those blocks: the stage's own per-call part
                overhead = d.stage_fixed_s
        if use_block_probe and d.head_s:
            head = d.head_s
        return DeviceCost(d.name, overhead, per, head, lim, lim_head)
    if tier is Tier.THROUGHPUT:
        assert d.flops
        return DeviceCost(d.name, overhead, 2.0 * w.params_per_block / d.flops, 0.0, lim, lim_head)
    raise ValueError("the working-set tier has no cost model")


def costs_for(
    devices: Sequence[DeviceReport], w: Workload, tier: Tier, use_block_probe: bool = True
) -> list[DeviceCost]:
    return [device_cost(d, w, tier, use_block_probe) for d in devices]


def fmt_bytes(n: float) -> str:
    """Bytes as decimal GB (or MB below one GB) for messages."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def memory_shortfall(d: DeviceReport, w: Workload, n: int, head: bool) -> str | None:
    """None if `n` blocks (and the head) fit on `d`, else a refusal naming the numbers."""
    return shortfall(d.name, d.memory_bytes, w, n, head)


def shortfall(name: str, memory_bytes: int, w: Workload, n: int, head: bool) -> str | None:
    """None if `n` blocks (and the head) fit in `memory_bytes`, else a refusal naming the numbers:
    "laptop-2: 14 blocks need 15.1 GB, has 12.0 GB (context 2048 x concurrency 1)"."""
    need = w.resident_bytes(n, head)
    if need <= memory_bytes:
        return None
    what = f"{n} block{'s' if n != 1 else ''}" + (" + head" if head else "")
    verb = "needs" if n == 1 and not head else "need"
    return (
        f"{name}: {what} {verb} {fmt_bytes(need)}, has {fmt_bytes(memory_bytes)} "
        f"(context {w.context} x concurrency {w.concurrency})"
    )
