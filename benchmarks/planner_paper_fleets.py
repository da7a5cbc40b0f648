"""Planner on the paper's three fleets (examples/fleets) x Qwen3-8B/14B/32B, and planning time.

For every fleet and model: each division's predicted bottleneck stage, uniform/kafila and
memory/kafila bottleneck ratios, utilisation (mean stage / bottleneck), imbalance, and Kafila's
bottleneck over the continuous lower bound (total bytes a token reads / total bandwidth; target:
within 5% wherever a division fits), next to the exact best integer division (a dynamic program over
every head choice under the same memory limits, independent of PARTITION), so each cell shows
whether any division could meet the target and what the 5% head margin costs. Then the time to
plan 64 blocks on 16 devices, ring order and head placement included (target: under 50 ms).
Predictions only: no device is run here.

    python3 benchmarks/planner_paper_fleets.py [--fleets DIR] [--runs N]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kafila.models.presets import resolve_manifest
from kafila.planner import DeviceReport, Nat, NatClass, plan, plan_all
from kafila.planner.cost import Tier, Workload, costs_for
from kafila.planner.exact import exact_division
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


def fleet_table(folder: Path) -> None:
    print(
        f"{'fleet':<17} {'model':<10} {'division':<8} {'fits':<4} {'bneck ms':>8} {'x kafila':>8} "
        f"{'util':>5} {'imbal':>6} head"
    )
    for fleet_name in FLEETS:
        fleet = parse_fleet((folder / f"{fleet_name}.toml").read_text())
        for model in MODELS:
            plans = plan_all(
                fleet.devices,
                resolve_manifest(model),
                context=fleet.context,
                concurrency=fleet.concurrency,
                objective="bottleneck",
            )
            k = plans["kafila"]
            for name, p in plans.items():
                ratio = p.bottleneck_s / k.bottleneck_s if (p.bottleneck_s and k.bottleneck_s) else None
                print(
                    f"{fleet_name:<17} {model:<10} {name:<8} {'yes' if p.feasible else 'NO':<4} "
                    f"{fmt(p.bottleneck_s and p.bottleneck_s * 1e3):>8} {fmt(ratio):>8} "
                    f"{fmt(p.utilisation and p.utilisation * 100, '.0f') + '%':>5} {fmt(p.imbalance):>6} "
                    f"{p.head or '-'}"
                )
                if not p.feasible:
                    print(f"{'':<17} refused: {p.reason}")


@dataclass(frozen=True)
class Cell:
    fleet: str
    model: str
    bound: float  # the bandwidth bound: total bytes read / total bandwidth
    relaxed: float  # fractional blocks, overheads and memory limits kept, best head
    exact_free: float | None  # best integer division, every head, memory limits lifted
    exact: float | None  # best integer division, every head, memory limits kept
    kafila_mu0: float | None  # PARTITION + head placement with mu = 0
    kafila: float | None  # the plan as shipped (mu = 5%)


def exact_cells(folder: Path) -> list[Cell]:
    cells = []
    for fleet_name in FLEETS:
        fleet = parse_fleet((folder / f"{fleet_name}.toml").read_text())
        for model in MODELS:
            manifest = resolve_manifest(model)
            w = Workload.of(manifest, fleet.context, fleet.concurrency)
            costs = costs_for(fleet.devices, w, Tier.FULL)
            for d, c in zip(fleet.devices, costs, strict=True):  # the head term is the manifest's read
                assert (
                    d.bandwidth_bytes_s and abs(c.head_s * d.bandwidth_bytes_s - manifest.head_read_bytes) < 1
                )
            free = [replace(c, limit=w.n_blocks, limit_head=w.n_blocks) for c in costs]
            exact, exact_free = exact_division(w.n_blocks, costs), exact_division(w.n_blocks, free)
            ctx, users, objective = fleet.context, fleet.concurrency, "bottleneck"
            k0 = plan(fleet.devices, manifest, context=ctx, concurrency=users, mu=0.0, objective=objective)
            k = plan(fleet.devices, manifest, context=ctx, concurrency=users, objective=objective)
            cells.append(
                Cell(
                    fleet_name,
                    model,
                    lower_bound_s(fleet.devices, model),
                    relaxed_bound_s(fleet.devices, model, fleet.context, fleet.concurrency),
                    exact_free.bottleneck if exact_free else None,
                    exact.bottleneck if exact else None,
                    k0.bottleneck_s if k0.feasible else None,
                    k.bottleneck_s if k.feasible else None,
                )
            )
    return cells


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or math.isinf(a) else f"{a / b:.3f}"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def exact_table(cells: list[Cell]) -> None:
    print(
        "\nKafila against the bandwidth bound and the exact best integer division (dynamic program over\n"
        "every head choice, same memory limits, kafila/planner/exact.py; independent of PARTITION):\n"
        f"{'fleet':<17} {'model':<10} {'bound':>6} {'exact':>6} {'kafila':>6} | {'exact/':>7} {'free/':>7} "
        f"{'relax/':>7} {'kafila/':>7} {'kafila/':>7} {'mu=0/':>7} {'any':>4}\n"
        f"{'':<17} {'':<10} {'ms':>6} {'ms':>6} {'ms':>6} | {'bound':>7} {'bound':>7} {'bound':>7} "
        f"{'bound':>7} {'exact':>7} {'exact':>7} {'<=5%':>4}"
    )
    for c in cells:
        fits = "-" if c.exact is None else ("yes" if c.exact <= 1.05 * c.bound else "no")
        print(
            f"{c.fleet:<17} {c.model:<10} {ms(c.bound):>6} {ms(c.exact):>6} {ms(c.kafila):>6} | "
            f"{ratio(c.exact, c.bound):>7} {ratio(c.exact_free, c.bound):>7} {ratio(c.relaxed, c.bound):>7} "
            f"{ratio(c.kafila, c.bound):>7} {ratio(c.kafila, c.exact):>7} {ratio(c.kafila_mu0, c.exact):>7} "
            f"{fits:>4}"
        )
    print(
        "exact/bound: the best any integer division can do; free/bound: the same with memory limits lifted\n"
        "(what overheads, the head read and whole blocks alone cost); relax/bound: fractional blocks with\n"
        "limits and overheads; kafila/exact: what the 5% head margin costs; mu=0/exact must be 1.000."
    )


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
    fleet_table(args.fleets)
    cells = exact_cells(args.fleets)
    exact_table(cells)
    fit = [c for c in cells if c.kafila is not None]
    gaps = [k / c.bound for c in fit if (k := c.kafila) is not None]
    best = [e / c.bound for c in fit if (e := c.exact) is not None]
    margin = [k / e for c in fit if (k := c.kafila) is not None and (e := c.exact) is not None]
    bad = [
        f"{c.fleet}/{c.model}"
        for c in fit
        if c.kafila_mu0 is None or c.exact is None or abs(c.kafila_mu0 / c.exact - 1) > 1e-9
    ]
    print(
        f"\nkafila / bound: median {statistics.median(gaps):.3f}, worst {max(gaps):.3f}, within 5% in "
        f"{sum(g <= 1.05 for g in gaps)} of {len(gaps)} feasible cells (target <= 1.05)\n"
        f"exact optimum / bound: median {statistics.median(best):.3f}, worst {max(best):.3f}, within 5% in "
        f"{sum(g <= 1.05 for g in best)} of {len(best)} "
        "(the best any integer division under these limits does)\n"
        f"kafila / exact optimum: {sum(r == 1.0 for r in margin)} of {len(margin)} cells equal, worst "
        f"{max(margin):.3f} (the mu = 5% head margin); kafila with mu = 0 / exact: "
        + ("1.000 in every cell" if not bad else f"DIFFERS in {bad}")
    )
    ratios = heuristic_vs_exhaustive(args.runs)
    print(
        f"ring heuristic (cheapest insertion + 2-opt) / exhaustive optimum on {args.runs} random 9-member "
        f"fleets: optimal in {sum(r == 1.0 for r in ratios)}, worst {max(ratios):.3f}"
    )
    t = planning_time(args.runs)
    print(
        f"planning time, 64 blocks on 16 devices, concurrency 4 (ring order + head + load division): median "
        f"{t * 1e3:.1f} ms over {args.runs} fleets (target < 50 ms)"
    )


if __name__ == "__main__":
    main()
