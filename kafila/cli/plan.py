"""`kafila plan FLEET.toml`: plan a fleet and compare Kafila's division with the baselines."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from kafila.cli.argtypes import count
from kafila.cli.host import add_objective_flag
from kafila.engine import QUANT_CHOICES

DIVISION_CHOICES = ("kafila", "uniform", "memory", "all")


def non_empty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "fleet", type=Path, help="fleet TOML: a [session] table and one [[device]] per member"
    )
    parser.add_argument(
        "--model",
        type=non_empty,
        help="preset (qwen3-8b, qwen3-14b, qwen3-32b, smollm2-135m), a local Hugging Face folder, a .gguf "
        "file or ollama:NAME[:TAG]; "
        "overrides [session] model",
    )
    parser.add_argument(
        "--context", type=count, help="declared context per request in tokens; overrides [session]"
    )
    parser.add_argument(
        "--concurrency",
        type=count,
        help="concurrent requests the KV cache is reserved for and the kafila division is planned "
        "for; overrides [session]",
    )
    parser.add_argument(
        "--division",
        choices=DIVISION_CHOICES,
        default="all",
        help="kafila (cost model), uniform (GPipe), memory (exo's memory-proportional) or all (default)",
    )
    add_objective_flag(parser)
    parser.add_argument("--dtype", default="bf16", help="weight dtype the model is priced in (default bf16)")
    parser.add_argument(
        "--quant",
        default="auto",
        choices=QUANT_CHOICES,
        help="weight format the blocks are priced in: int8 (1.06 bytes per weight) or q4 (0.625), the "
        "embedding/unembedding in int8 (docs/weights.md); auto = as the folder stores them (floats "
        "for a preset)",
    )
    parser.add_argument(
        "--rule",
        choices=("linux", "paper"),
        default="linux",
        help="NAT pair rule: linux (measured on Linux NATs, default) "
        "or paper (direct iff one side is permissive)",
    )
    parser.add_argument(
        "--json", action="store_true", help='print {"divisions": {name: {...}}} instead of a table'
    )


def main(args: argparse.Namespace) -> int:
    from kafila.models.presets import resolve_model
    from kafila.obs.log import get_logger
    from kafila.planner import DIVISIONS, plan_all
    from kafila.planner.fleet import FleetError, parse_fleet
    from kafila.planner.reachability import RULES

    try:
        base = args.fleet.parent
        try:
            text = args.fleet.read_text(encoding="utf-8")  # TOML is UTF-8 whatever the locale
        except UnicodeDecodeError as exc:
            raise FleetError(f"{args.fleet}: not valid TOML: {exc}") from exc
        except OSError as exc:  # the reason alone: OSError's text names the path a second time
            raise FleetError(f"{args.fleet}: {exc.strerror or exc}") from exc
        fleet = parse_fleet(text, str(args.fleet), lambda p: json.loads((base / p).read_text()))
        model = fleet.model if args.model is None else args.model
        context = fleet.context if args.context is None else args.context
        concurrency = fleet.concurrency if args.concurrency is None else args.concurrency
        devices = fleet.devices
        if model != fleet.model:  # probed block times were for the fleet's model
            devices = tuple(replace(d, block_s=None, block_dispatch_s=None, head_s=None) for d in devices)
        config, manifest = resolve_model(model, args.dtype, args.quant)
        given = "--context" if args.context is not None else f"{args.fleet}: [session] context"
        config.check_context(context, model, given)  # as `kafila host` refuses it
        divisions = DIVISIONS if args.division == "all" else (args.division,)
        plans = plan_all(
            devices,
            manifest,
            context=context,
            concurrency=concurrency,
            divisions=divisions,
            rule=RULES[args.rule],
            objective=args.objective,
        )
    except (OSError, FleetError, ValueError, KeyError) as exc:
        print(f"kafila plan: {exc}", file=sys.stderr)
        return 2
    first = plans[divisions[0]]
    get_logger("kafila.plan").info(
        "planned", fleet=str(args.fleet), model=model, divisions=list(divisions), feasible=first.feasible
    )
    if args.json:
        print(json.dumps({"divisions": {n: p.summary() for n, p in plans.items()}}, indent=2))
    else:
        print(render_table(str(args.fleet), model, manifest.n_blocks, plans))
    return 0 if first.feasible else 1


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def render_table(fleet: str, model: str, n_blocks: int, plans: dict[str, Any]) -> str:
    any_plan = next(iter(plans.values()))
    lines = [
        f"{fleet}: {model} ({n_blocks} blocks), context {any_plan.context} x concurrency "
        f"{any_plan.concurrency}, tier {any_plan.tier}, ring ordered by {any_plan.ordering}",
        "",
        f"{'division':<9} {'fits':<5} {'head':<12} {'bneck ms':>9} {'imbal':>6} {'util':>5} "
        f"{'circuit ms':>10} {'tok/s':>7} {'ms/token':>8} {'relayed':>7}",
    ]
    for name, p in plans.items():
        lines.append(
            f"{name:<9} {'yes' if p.feasible else 'NO':<5} {p.head or '-':<12} "
            f"{_fmt(p.bottleneck_s and p.bottleneck_s * 1e3, '.2f'):>9} {_fmt(p.imbalance, '.2f'):>6} "
            f"{_pct(p.utilisation):>5} "
            f"{_fmt(p.circuit_s and p.circuit_s * 1e3, '.1f'):>10} {_fmt(p.tokens_s, '.1f'):>7} "
            f"{_fmt(p.per_token_s and p.per_token_s * 1e3, '.2f'):>8} "
            f"{len(p.edges) and p.relayed:>7}"
        )
    lines += [
        f"(tok/s: one request alone, 1 / circuit; ms/token: per token of the {any_plan.concurrency} "
        "declared requests together, max(bneck, circuit / concurrency))",
        "",
        "blocks per device (stage ms), in ring order from the head:",
    ]
    names = list(dict.fromkeys(n for p in plans.values() for n in p.order))
    lines.append(f"{'device':<12} " + " ".join(f"{n:<16}" for n in plans))
    for dev in names:
        cells = []
        for p in plans.values():
            stage = next((s for s in p.stages if s.name == dev), None)
            cells.append(
                "-"
                if stage is None
                else f"{stage.n_blocks} ({_fmt(stage.cost_s and stage.cost_s * 1e3, '.2f')})"
            )
        lines.append(f"{dev:<12} " + " ".join(f"{c:<16}" for c in cells))
    refused = [(n, p.reason) for n, p in plans.items() if not p.feasible]
    if refused:
        lines += ["", "refused:"] + [f"  {n}: {r}" for n, r in refused]
    notes = list(any_plan.notes)
    if not any_plan.network_priced and any_plan.edges:
        notes.append("some member has no rtt_ms, so circuit time leaves out edge latency")
    if notes:
        lines += [""] + [f"note: {n}" for n in notes]
    return "\n".join(lines)
