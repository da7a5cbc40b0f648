"""`kafila demo`: a rendezvous and three members on this machine, unequal on purpose."""

from __future__ import annotations

import argparse

PROMPT = "What is the capital of France? Answer in one sentence."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model to serve (default smollm2-135m)")
    parser.add_argument(
        "--shares",
        default="1,0.5,0.25",
        help="CPU share of one core for each member, comma-separated; its length is the number of "
        "members (default 1,0.5,0.25)",
    )
    parser.add_argument(
        "--slow-by",
        default="pace",
        choices=["pace", "quota"],
        help="how a share slows its member: pace (default) pins it to one CPU and stretches each "
        "computation to CPU time / share (--emulate-speed); quota uses a cgroup v1 cpu quota (root)",
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

    from kafila.session.localfleet import LocalFleet

    shares = tuple(float(s) for s in args.shares.split(","))
    fleet = LocalFleet(
        shares, args.model, args.division, context=512, workdir=Path(args.workdir), slow_by=args.slow_by
    )
    try:
        print(f"starting a rendezvous and {len(shares)} members (probe, plan, links, weight fetch) ...")
        fleet.start()
        print(fleet.describe())
        if fleet.shares_applied:
            how = "emulated pace" if args.slow_by == "pace" else "cgroup v1 cpu quota"
            print(f"members limited to {', '.join(f'{s:.0%}' for s in shares)} of one CPU ({how})")
        doc = fleet.session()
        print(f"\nring {' -> '.join(doc['ring'])} (head {doc['head']}), division {doc['division']}")
        print("predicted, this division next to uniform and memory-proportional:")
        print(fleet.predicted_table())
        member = fleet.not_head()
        print(f"\nasking {member} (not the head: it forwards to {doc['head']}): {args.prompt}")
        body = {"model": args.model, "messages": [{"role": "user", "content": args.prompt}],
                "max_tokens": args.max_tokens, "temperature": 0, "stream": True}  # fmt: skip
        start = time.perf_counter()
        with httpx.stream("POST", f"{fleet.url(member)}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
                    print(delta, end="", flush=True)
        print(f"\n({time.perf_counter() - start:.1f} s)")
        print("\nAPIs (OpenAI /v1, Ollama /api, /session, /traces, /metrics):")
        for name, url in fleet.api_urls.items():
            print(f"  {name}: {url}")
        print(f"traces: {fleet.workdir}/*.trace.jsonl  (kafila trace summarize FILE)")
        if not args.no_wait:
            print("serving until Ctrl-C")
            while all(m.proc is not None and m.proc.poll() is None for m in fleet.members):
                time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.close()
    return 0
