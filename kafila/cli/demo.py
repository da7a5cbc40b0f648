"""`kafila demo`: a rendezvous and three members on this machine, unequal on purpose."""

from __future__ import annotations

import argparse

PROMPT = "What is the capital of France? Answer in one sentence."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model to serve (default smollm2-135m)")
    parser.add_argument(
        "--shares",
        default="1,0.5,0.25",
        help="CPU share of one core for each member, comma-separated (cgroup v1 cpu, root only); "
        "its length is the number of members (default 1,0.5,0.25)",
    )
    parser.add_argument(
        "--division", default="kafila", choices=["kafila", "uniform", "memory"], help="division"
    )
    parser.add_argument(
        "--prompt", default=PROMPT, help="the question asked through a member that is not the head"
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="answer length limit (default 48)")
    parser.add_argument("--workdir", default="/tmp/kafila-demo", help="traces and the session code go here")
    parser.add_argument(
        "--no-wait", action="store_true", help="stop after the answer instead of serving until Ctrl-C"
    )


def main(args: argparse.Namespace) -> int:
    import json
    import time
    from pathlib import Path

    import httpx

    from kafila.session.local import LocalFleet, cgroups_available

    shares = tuple(float(s) for s in args.shares.split(","))
    if cgroups_available():
        print(f"members limited to {', '.join(f'{s:.0%}' for s in shares)} of one CPU (cgroup v1 cpu)")
    else:
        print("not root (or no cgroup v1 cpu controller): members are NOT CPU-limited this time")
    fleet = LocalFleet(args.model, shares, args.division, workdir=Path(args.workdir))
    try:
        print("starting a rendezvous and", len(shares), "members (probe, plan, links, weight fetch) ...")
        fleet.start()
        doc = fleet.session()
        _print_plans(doc)
        member = fleet.not_head()
        print(f"\nasking {member.name} (not the head: it forwards to {doc['head']}): {args.prompt}")
        body = {"model": args.model, "messages": [{"role": "user", "content": args.prompt}],
                "max_tokens": args.max_tokens, "temperature": 0, "stream": True}  # fmt: skip
        start, n = time.perf_counter(), 0
        with httpx.stream("POST", f"http://{member.api}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
                    n += bool(delta)
                    print(delta, end="", flush=True)
        print(f"\n({n} chunks in {time.perf_counter() - start:.1f} s)")
        print("\nAPIs (OpenAI /v1, Ollama /api, /session, /traces, /metrics):")
        for m in fleet.members:
            print(f"  {m.name}: http://{m.api}")
        print(f"traces: {args.workdir}/trace-*.jsonl  (kafila trace summarize FILE)")
        if not args.no_wait:
            print("serving until Ctrl-C")
            while all(m.proc.poll() is None for m in fleet.members):
                time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.close()
    return 0


def _print_plans(doc: dict) -> None:  # type: ignore[type-arg]
    print(f"\nring {' -> '.join(doc['ring'])} (head {doc['head']}), division {doc['division']}")
    print(f"{'division':<9} {'blocks':<36} {'bneck ms':>9} {'imbal':>6} {'util':>5} {'pred tok/s':>10}")
    for name, p in (doc.get("plan", {}).get("divisions") or {}).items():
        if not p.get("feasible"):
            print(f"{name:<9} refused: {p.get('reason')}")
            continue
        blocks = " ".join(f"{k}:{v}" for k, v in p["blocks"].items())
        print(
            f"{name:<9} {blocks:<36} {p['bottleneck_ms'] or 0:>9.2f} {p['imbalance'] or 0:>6.2f} "
            f"{p['utilisation'] or 0:>5.0%} {p['tokens_s'] or 0:>10.1f}"
        )
