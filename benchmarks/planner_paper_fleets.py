"""Planner on the paper's three fleets (examples/fleets) x Qwen3-8B/14B/32B, and planning time.

For every fleet and model: each division's predicted bottleneck stage, uniform/kafila and
memory/kafila bottleneck ratios, utilisation (mean stage / bottleneck), imbalance, and Kafila's
bottleneck over the continuous lower bound (total bytes a token reads / total bandwidth; target:
within 5% wherever a division fits). Then the time to plan 64 blocks on 16 devices, ring order and
head placement included (target: under 50 ms). Predictions only: no device is run here.

    python3 benchmarks/planner_paper_fleets.py [--fleets DIR] [--runs N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from kafila.models.presets import resolve_manifest
from kafila.planner import DeviceReport, Nat, NatClass, plan, plan_all
from kafila.planner.cost import Tier, Workload, costs_for
from kafila.planner.fleet import parse_fleet
from kafila.planner.order import RingPrices, cheapest_insertion, exhaustive, two_opt
from kafila.planner.reachability import DEFAULT_RULE

MODELS = ("qwen3-8b", "qwen3-14b", "qwen3-32b")
FLEETS = ("lan", "uscentral", "intercontinental")


def lower_bound_s(devices: tuple[DeviceReport, ...], model: str) -> float:
    m = resolve_manifest(model)
    total_read = sum(m.block_bytes) + m.head_read_bytes
    return total_read / sum(d.bandwidth_bytes_s or 0.0 for d in devices)


def relaxed_bound_s(devices: tuple[DeviceReport, ...], model: str, context: int, concurrency: int) -> float:
    """The cost model's own continuous relaxation: fractional blocks, each device's overhead and
    memory limit kept, best head; no integer division can beat it."""
    w = Workload.of(resolve_manifest(model), context, concurrency)
    costs = costs_for(devices, w, Tier.FULL)
    best = float("inf")
    for h in range(len(costs)):

        def held(tau: float, h: int = h) -> float:
            if tau < costs[h].fixed(True):  # the head pays its read whatever it holds
                return 0.0
            return sum(
                min(c.lim(i == h), max(0.0, (tau - c.fixed(i == h)) / c.per_block_s))
                for i, c in enumerate(costs)
            )

        lo, hi = 0.0, 10.0
        if held(hi) < w.n_blocks:
            continue
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if held(mid) >= w.n_blocks else (mid, hi)
        best = min(best, hi)
    return best


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def fleet_table(folder: Path) -> list[float]:
    print(
        f"{'fleet':<17} {'model':<10} {'division':<8} {'fits':<4} {'bneck ms':>8} {'x kafila':>8} "
        f"{'util':>5} {'imbal':>6} {'head':<8} {'vs bound':>8} {'vs relaxed':>10}"
    )
    gaps, relaxed_gaps = [], []
    for fleet_name in FLEETS:
        fleet = parse_fleet((folder / f"{fleet_name}.toml").read_text())
        for model in MODELS:
            plans = plan_all(
                fleet.devices, resolve_manifest(model), context=fleet.context, concurrency=fleet.concurrency
            )
            k = plans["kafila"]
            bound = lower_bound_s(fleet.devices, model)
            relaxed = relaxed_bound_s(fleet.devices, model, fleet.context, fleet.concurrency)
            for name, p in plans.items():
                ratio = p.bottleneck_s / k.bottleneck_s if (p.bottleneck_s and k.bottleneck_s) else None
                gap = k.bottleneck_s / bound if (name == "kafila" and k.feasible and k.bottleneck_s) else None
                rgap = k.bottleneck_s / relaxed if gap else None
                if gap and rgap:
                    gaps.append(gap)
                    relaxed_gaps.append(rgap)
                print(
                    f"{fleet_name:<17} {model:<10} {name:<8} {'yes' if p.feasible else 'NO':<4} "
                    f"{fmt(p.bottleneck_s and p.bottleneck_s * 1e3):>8} {fmt(ratio):>8} "
                    f"{fmt(p.utilisation and p.utilisation * 100, '.0f') + '%':>5} {fmt(p.imbalance):>6} "
                    f"{p.head or '-':<8} {fmt(gap, '.3f') if gap else '':>8} "
                    f"{fmt(rgap, '.3f') if rgap else '':>10}"
                )
                if not p.feasible:
                    print(f"{'':<17} refused: {p.reason}")
    return gaps, relaxed_gaps


def synthetic_fleet(n: int, seed: int) -> list[DeviceReport]:
    rng = random.Random(seed)
    classes = list(NatClass)
    return [
        DeviceReport(
            name=f"dev{i}",
            memory_bytes=int(rng.uniform(12, 80) * 1e9),
            bandwidth_bytes_s=rng.uniform(90, 1400) * 1e9,
            overhead_s=rng.uniform(20, 120) * 1e-6,
            flops=rng.uniform(5, 350) * 1e12,
            nat=Nat(rng.choice(classes)),
            rtt_s=rng.uniform(10, 120) * 1e-3,
        )
        for i in range(n)
    ]


def planning_time(runs: int) -> float:
    manifest = resolve_manifest("qwen3-32b")  # 64 blocks
    times = []
    for seed in range(runs):
        fleet = synthetic_fleet(16, seed)
        t0 = time.perf_counter()
        p = plan(fleet, manifest, context=8192, concurrency=4)
        times.append(time.perf_counter() - t0)
        assert p.feasible, p.reason
    return statistics.median(times)


def heuristic_vs_exhaustive(runs: int) -> list[float]:
    """Ring price of the >9-member heuristic over the exhaustive optimum, on 9-member fleets."""
    ratios = []
    for seed in range(runs):
        prices = RingPrices(synthetic_fleet(9, seed), DEFAULT_RULE)
        best = prices.ring(exhaustive(prices, 9, 0)) // prices.big
        found = prices.ring(two_opt(prices, cheapest_insertion(prices, 9, 0))) // prices.big
        ratios.append(found / best)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--fleets", type=Path, default=Path(__file__).resolve().parents[1] / "examples" / "fleets"
    )
    ap.add_argument("--runs", type=int, default=20, help="synthetic 16-device fleets to time")
    args = ap.parse_args()
    gaps, relaxed = fleet_table(args.fleets)
    print(
        f"\nkafila bottleneck / continuous lower bound (total bytes read / total bandwidth): median "
        f"{statistics.median(gaps):.3f}, worst {max(gaps):.3f} over {len(gaps)} feasible cells "
        "(target <= 1.05)"
    )
    print(
        f"kafila bottleneck / relaxed bound (same cost model, fractional blocks, memory limits and "
        f"overheads kept): median {statistics.median(relaxed):.3f}, worst {max(relaxed):.3f}"
    )
    ratios = heuristic_vs_exhaustive(args.runs)
    print(
        f"ring heuristic (cheapest insertion + 2-opt) / exhaustive optimum on {args.runs} random 9-member "
        f"fleets: optimal in {sum(r == 1.0 for r in ratios)}, worst {max(ratios):.3f}"
    )
    t = planning_time(args.runs)
    print(
        f"planning time, 64 blocks on 16 devices (ring order + head + PARTITION): median "
        f"{t * 1e3:.1f} ms over {args.runs} fleets (target < 50 ms)"
    )


if __name__ == "__main__":
    main()
