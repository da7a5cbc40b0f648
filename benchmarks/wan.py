"""One user's decode over a WAN ring: three- and four-member sessions of `kafila` processes in the
WAN lab (tests/natlab/wanlab.py: network namespaces behind home routers, every public edge held for
a one-way delay by a user-space router; root), asked a chat question, a summary of a given text and
a code edit at several one-way delays per edge and with loss. Per condition and prompt, medians over
`--runs` greedy requests (streamed) with the spread (half the range):

- ms per token: first to last streamed chunk over the chunks after the first (a chunk per token);
- tokens per circuit: the head's median circuit (time around the ring per decode step, from its
  request record where it wrote one) over ms per token (plain decoding: about 1);
- p95 token gap: the 95th percentile of the gaps between streamed chunks;
- first token: request sent -> first streamed chunk;
- same: whether the answer is the text the first condition (no delay) gave.

    python3 benchmarks/wan.py [--members 3,4] [--delays 0,5,20,40] [--loss 20:0.01] [--runs 3]

The session forms with the lab's router out of the way (the weights come at the kernel's rate), then
the lab shapes every edge per condition; the same session serves every condition of one ring size.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _session_common import Load, median, spread

from tests.natlab.delayline import Shape
from tests.natlab.lab import RDV_ADDRS, missing_requirements, netns
from tests.natlab.members import API, form, stop
from tests.natlab.wanlab import WanLab
from tests.net.harness import start_rendezvous

ESSAY = (
    "The printing press, developed by Johannes Gutenberg around 1440, changed how knowledge spread in "
    "Europe. Before it, books were copied by hand, which made them rare and expensive, and errors crept "
    "in with every copy. Movable metal type let printers produce hundreds of identical pages a day. "
    "Within fifty years, presses operated in more than two hundred cities, and millions of books had "
    "been printed. Cheaper books raised literacy, helped scientists share results exactly, and let new "
    "religious and political ideas reach people far from where they were written."
)
CODE = "def area(w, h):\n    x = w * h\n    return x\n\n\ndef perimeter(w, h):\n    x = 2 * (w + h)\n    return x\n"  # noqa: E501
PROMPTS = {
    "chat": "What should I pack for a weekend hiking trip?",
    "summary": f"Summarize this text in two sentences.\n\n{ESSAY}",
    "code-edit": f"Rename the variable x to result in this Python code and show the whole code.\n\n{CODE}",
}
HEADER = "| prompt | ms per token | tokens per circuit | p95 token gap ms | first token ms | tokens | same |"
HEADER = "| prompt | ms per token | tokens per circuit | p95 token gap ms | first token ms | tokens | same |"
# How a request is decoded. Plain decoding is one circuit per token; a speculative mode adds its
# name here and its request fields in `decoding_fields`.
DECODINGS = ("plain",)

CLIENT = """
import httpx, json, sys, time
prompts, max_tokens, runs, extra = json.loads(sys.argv[1])


def records(client):
    return [t for t in client.get("http://API/traces").json()["traces"] if t["type"] == "request"]


def ask(client, prompt, max_tokens):
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    t0, times, text = time.perf_counter(), [], []
    with client.stream("POST", "http://API/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if piece:
                times.append(time.perf_counter() - t0)
                text.append(piece)
    return times, "".join(text)


out = []
with httpx.Client(timeout=600) as client:
    seen = len(records(client))
    for name, prompt in prompts.items():
        for _ in range(runs):
            times, text = ask(client, prompt, max_tokens)
            out.append({"prompt": name, "times": times, "text": text})
    # the head writes a request's record once every member reported its hops, which may come with
    # the next request: one more short request, then every record in request order
    for _ in range(3):
        ask(client, "Hi", 2)
        got = records(client)
        if len([t for t in got[seen:] if t["completion_tokens"] > 2]) >= len(out):
            break
    got = [t for t in got[seen:] if t["completion_tokens"] > 2]  # not the short ones
    for answer, record in zip(out, got):
        answer["trace"] = record
print(json.dumps(out))
""".replace("API", API)


def decoding_fields(decoding: str) -> dict[str, Any]:
    """Extra request fields for a decoding mode (plain: none)."""
    if decoding == "plain":
        return {}
    raise ValueError(f"decoding {decoding!r} is not one of {DECODINGS}")


def ask_all(ns: str, max_tokens: int, runs: int, decoding: str) -> list[dict[str, Any]]:
    arg = json.dumps([PROMPTS, max_tokens, runs, decoding_fields(decoding)])
    got = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, arg], capture_output=True, timeout=3600
    )
    if got.returncode != 0:
        raise RuntimeError(f"client in {ns} exited with {got.returncode}: {got.stderr.decode()[-800:]}")
    return json.loads(got.stdout)


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20)[-1] if len(xs) >= 2 else float("nan")


def summarize(answers: list[dict[str, Any]], reference: dict[str, str]) -> list[str]:
    """One table row per prompt: medians (spread) over the runs."""
    rows = []
    for name in PROMPTS:
        mine = [a for a in answers if a["prompt"] == name]
        # ms per token from the stream (a chunk per token); the circuit from the head's record,
        # where it wrote one for the request
        per_token = [1000 * (a["times"][-1] - a["times"][0]) / (len(a["times"]) - 1) for a in mine]
        per_circuit = [
            a["trace"]["circuit_ms"] / t for a, t in zip(mine, per_token, strict=True) if "trace" in a
        ]
        gaps = [p95([1000 * (b - a) for a, b in zip(x["times"], x["times"][1:], strict=False)]) for x in mine]
        first = [1000 * a["times"][0] for a in mine if a["times"]]
        same = all(a["text"] == reference.get(name, a["text"]) for a in mine)
        rows.append(
            f"| {name} | {median(per_token):.0f} ({spread(per_token):.0f}) | {median(per_circuit):.2f} "
            f"({spread(per_circuit):.2f}) | {median(gaps):.0f} ({spread(gaps):.0f}) | {median(first):.0f} "
            f"({spread(first):.0f}) | {len(mine[0]['times'])} | {'yes' if same else 'NO'} |"
        )
    return rows


async def ring(members: int, conditions: list[tuple[float, float]], args: argparse.Namespace) -> None:
    with WanLab() as lab, tempfile.TemporaryDirectory() as tmp:
        with netns(lab.rdv):
            rdv = await start_rendezvous(RDV_ADDRS[0], RDV_ADDRS[1])
        lab.bypass()
        sites = [lab.add_site("permissive") for _ in range(members)]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            await form(sites, rdv, Path(tmp), procs, ready_s=900)  # a loaded machine probes slowly
            reference: dict[str, str] = {}
            for delay_ms, loss in conditions:
                lab.shape(Shape(delay=delay_ms / 1000, loss=loss))
                await asyncio.to_thread(ask_all, sites[0].host, args.max_tokens, 1, args.decoding)  # settle
                load = Load()
                answers = await asyncio.to_thread(
                    ask_all, sites[0].host, args.max_tokens, args.runs, args.decoding
                )
                for a in answers:
                    reference.setdefault(a["prompt"], a["text"])
                what = (
                    f"{members} members, {delay_ms:g} ms one way per edge, loss {loss:.0%}, {args.decoding}"
                )
                print(f"\n{what}, {args.runs} runs per prompt; {load.report()}")
                print(HEADER)
                print("|---|---|---|---|---|---|---|")
                print("\n".join(summarize(answers, reference)), flush=True)
        finally:
            stop(procs)
            await rdv.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", default="3,4", help="ring sizes, comma-separated")
    p.add_argument(
        "--delays", default="0,5,20,40", help="one-way delays per edge in ms (the first is the reference)"
    )
    p.add_argument("--loss", default="20:0.01", help="DELAY_MS:LOSS conditions with loss, comma-separated")
    p.add_argument("--runs", type=int, default=3, help="requests per prompt and condition")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--decoding", choices=DECODINGS, default="plain")
    args = p.parse_args()
    reason = missing_requirements()
    if reason:
        sys.exit(reason)
    conditions = [(float(d), 0.0) for d in args.delays.split(",")]
    conditions += [(float(d), float(x)) for d, x in (c.split(":") for c in args.loss.split(",") if c)]
    now = datetime.datetime.now(datetime.UTC)
    print(f"benchmarks/wan.py {' '.join(sys.argv[1:])}; {now:%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPUs")
    for members in (int(m) for m in args.members.split(",")):
        asyncio.run(ring(members, conditions, args))


if __name__ == "__main__":
    main()
