"""One user's decode over a WAN ring: three- and four-member sessions of `kafila` processes in the
WAN lab (tests/natlab/wanlab.py: network namespaces behind home routers, every public edge held for
a one-way delay by a user-space router; root), asked a chat question, a summary of a given text and
a code edit at several one-way delays per edge and with loss, decoding plainly (the head's
`--draft none`) or speculatively (`--draft lookup`: prompt lookup drafts, one circuit verifying
several tokens). Per condition and prompt, medians over `--runs` greedy requests (streamed) with
the spread (half the range):

- ms per token: first to last streamed chunk over the tokens after the first (the answer's usage);
- tokens per circuit: the tokens after the first over the decode circuits that gave them (the
  drafted tokens kept, from the usage's accepted_prediction_tokens: 1 for plain decoding);
- drafted / kept: the answer's drafted tokens verified and those kept (the usage's accepted and
  rejected prediction tokens);
- circuit ms: the head's median time around the ring per decode step (its request record);
- circuit / token: circuit ms over ms per token (plain decoding: about 1, less where the head
  waits between steps; speculative: about the tokens per circuit, where drafting costs nothing);
- p95 token gap: the 95th percentile of the gaps between streamed chunks (a chunk per circuit);
- first token: request sent -> first streamed chunk;
- same: whether the answer is the text the first decoding at the first condition gave.

    python3 benchmarks/wan.py [--members 3,4] [--delays 0,5,20,40] [--loss 20:0.01] [--runs 3] [--spec]
                           [--decodings plain,lookup,model] [--draft-model NAME]

`--spec` (or `--decodings plain,lookup,model`) measures plain decoding, prompt lookup and a draft
model (`--draft-model`, by default the served model's own Q4_1 GGUF drafting its float32 ring)
side by side: one session of each per ring size, all serving at once in the same lab on their own
sites, their requests alternating set by set at every condition so the machine's load falls on
each alike; a last table gives each decoding's tokens per second over plain decoding's. The
sessions form with the lab's router out of the way (the weights come at the kernel's rate), then
the lab shapes every edge per condition.
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
HEADER = (
    "| prompt | ms per token | tokens per circuit | drafted / kept | circuit ms | circuit / token "
    "| p95 token gap ms | first token ms | tokens | same |"
)
# How the head decodes: its --draft for each decoding (plain: one circuit per token)
# every member's flags for each decoding (MODEL: --draft-model's name)
DECODINGS = {
    "plain": ("--draft", "none"),
    "lookup": ("--draft", "lookup"),
    "model": ("--draft", "MODEL"),
    "ahead": ("--draft", "lookup", "--draft-ahead", "1"),  # lookup, one step drafted ahead
}

CLIENT = """
import httpx, json, sys, time
prompts, max_tokens, runs, extra = json.loads(sys.argv[1])


def records(client):
    return [t for t in client.get("http://API/traces").json()["traces"] if t["type"] == "request"]


def ask(client, prompt, max_tokens):
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    t0, times, text, usage = time.perf_counter(), [], [], {}
    with client.stream("POST", "http://API/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the answer failed: {chunk['error']}")
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or [{}]
            piece = choices[0].get("delta", {}).get("content")
            if piece:
                times.append(time.perf_counter() - t0)
                text.append(piece)
    return times, "".join(text), usage


out = []
with httpx.Client(timeout=600) as client:
    seen = len(records(client))
    for name, prompt in prompts.items():
        for _ in range(runs):
            times, text, usage = ask(client, prompt, max_tokens)
            out.append({"prompt": name, "times": times, "text": text, "usage": usage})
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


def ask_all(ns: str, max_tokens: int, runs: int) -> list[dict[str, Any]]:
    arg = json.dumps([PROMPTS, max_tokens, runs, {}])
    got = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, arg], capture_output=True, timeout=3600
    )
    if got.returncode != 0:
        raise RuntimeError(f"client in {ns} exited with {got.returncode}: {got.stderr.decode()[-800:]}")
    return json.loads(got.stdout)


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20)[-1] if len(xs) >= 2 else float("nan")


def tokens_per_circuit(usage: dict[str, Any]) -> float:
    """The answer's tokens after the first over the decode circuits that gave them: each circuit
    gave one token plus the drafted tokens it kept."""
    after_first = usage["completion_tokens"] - 1
    kept = (usage.get("completion_tokens_details") or {}).get("accepted_prediction_tokens", 0)
    return after_first / max(after_first - kept, 1)


def hop_lines(answers: list[dict[str, Any]]) -> list[str]:
    """Per answer with a head's record: its circuit, the time outside every stage's compute, each
    stage's compute and each ring hop's path and QUIC round trip at the request's end."""
    out = []
    for a in answers:
        t = a.get("trace")
        if t is None:
            continue
        stages = " ".join(f"{s['member']} {s['measured_ms']:.0f}" for s in t["stages"])
        hops = " ".join(f"{h['src']}->{h['dst']} {h['path']} {h['rtt_ms'] or 0:.0f}" for h in t["hops"])
        out.append(
            f"  {a['prompt']}: circuit {t['circuit_ms']:.0f} ms, transit {t['transit_ms']:.0f} ms, "
            f"prefill {1000 * t['prefill_s']:.0f} ms; stages (ms) {stages}; hops (RTT ms) {hops}"
        )
    return out


def summarize(answers: list[dict[str, Any]], reference: dict[str, str]) -> list[str]:
    """One table row per prompt: medians (spread) over the runs."""
    rows = []
    for name in PROMPTS:
        mine = [a for a in answers if a["prompt"] == name]
        # ms per token from the stream (a chunk per circuit) and the usage; the circuit from the
        # head's record, where it wrote one for the request
        per_token = [ms_per_token(a) for a in mine]
        per_circuit = [tokens_per_circuit(a["usage"]) for a in mine]
        circuit = [a["trace"]["circuit_ms"] for a in mine if "trace" in a]
        ratio = [a["trace"]["circuit_ms"] / t for a, t in zip(mine, per_token, strict=True) if "trace" in a]
        gaps = [p95([1000 * (b - a) for a, b in zip(x["times"], x["times"][1:], strict=False)]) for x in mine]
        first = [1000 * a["times"][0] for a in mine if a["times"]]
        same = all(a["text"] == reference.get(name, a["text"]) for a in mine)
        details = [a["usage"].get("completion_tokens_details") or {} for a in mine]
        kept = [d.get("accepted_prediction_tokens", 0) for d in details]
        drafted = [k + d.get("rejected_prediction_tokens", 0) for k, d in zip(kept, details, strict=True)]
        rows.append(
            f"| {name} | {median(per_token):.0f} ({spread(per_token):.0f}) | {median(per_circuit):.2f} "
            f"({spread(per_circuit):.2f}) | {median(drafted):.0f} / {median(kept):.0f} | "
            f"{median(circuit):.0f} ({spread(circuit):.0f}) | "
            f"{median(ratio):.2f} ({spread(ratio):.2f}) | {median(gaps):.0f} ({spread(gaps):.0f}) | "
            f"{median(first):.0f} ({spread(first):.0f}) | {mine[0]['usage']['completion_tokens']} | "
            f"{'yes' if same else 'NO'} |"
        )
    return rows


async def ring(
    members: int, conditions: list[tuple[float, float]], decodings: list[str], args: argparse.Namespace
) -> None:
    """One session per decoding, all serving at once in one lab (each on its own sites); at every
    condition their requests alternate set by set, so the machine's load falls on each alike."""
    with WanLab() as lab, tempfile.TemporaryDirectory() as tmp:
        with netns(lab.rdv):
            rdv = await start_rendezvous(RDV_ADDRS[0], RDV_ADDRS[1])
        groups = {d: [lab.add_site("permissive") for _ in range(members)] for d in decodings}
        reference: dict[str, str] = {}  # the first decoding's answers at the first condition
        procs: list[subprocess.Popen[bytes]] = []
        try:
            lab.bypass()  # sessions form with the router out of the way: the weights at the kernel's rate
            for decoding in decodings:
                logs = Path(tmp) / decoding
                logs.mkdir()
                drafting = draft_flags(decoding, args)  # every member's: the plan may put the head anywhere
                await form(groups[decoding], rdv, logs, procs, ready_s=900, member_args=drafting)
            for delay_ms, loss in conditions:
                lab.shape(Shape(delay=delay_ms / 1000, loss=loss))
                answers, load = await condition({d: g[0].host for d, g in groups.items()}, args)
                for decoding in decodings:
                    for a in answers[decoding]:
                        reference.setdefault(a["prompt"], a["text"])
                    what = f"{members} members, {delay_ms:g} ms one way per edge, loss {loss:.0%}, {decoding}"
                    print(f"\n{what}, {args.runs} runs per prompt; {load}")
                    print(HEADER)
                    print("|---|---|---|---|---|---|---|---|---|---|")
                    print("\n".join(summarize(answers[decoding], reference)), flush=True)
                    if args.hops:
                        print("\n".join(hop_lines(answers[decoding])), flush=True)
                if len(decodings) > 1:
                    print("\n".join(speedups(answers, decodings)), flush=True)
        finally:
            stop(procs)
            await rdv.stop()


def draft_flags(decoding: str, args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(args.draft_model if f == "MODEL" else f for f in DECODINGS[decoding])


async def condition(
    hosts: dict[str, str], args: argparse.Namespace
) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """Every prompt asked `args.runs` times of each session, the sessions alternating run by run
    after one settling set each; with the machine's load over the whole."""
    for ns in hosts.values():
        await asyncio.to_thread(ask_all, ns, args.max_tokens, 1)  # settle
    load = Load()
    answers: dict[str, list[dict[str, Any]]] = {d: [] for d in hosts}
    for _ in range(args.runs):
        for decoding, ns in hosts.items():
            answers[decoding] += await asyncio.to_thread(ask_all, ns, args.max_tokens, 1)
    return answers, load.report()


def speedups(answers: dict[str, list[dict[str, Any]]], decodings: list[str]) -> list[str]:
    """Per prompt, each decoding's tokens per second over the first decoding's (medians of ms per token)."""
    rows = ["", "| prompt | " + " | ".join(f"{d} / {decodings[0]}" for d in decodings[1:]) + " |"]
    rows.append("|---|" + "---|" * (len(decodings) - 1))
    for name in PROMPTS:
        base = median([ms_per_token(a) for a in answers[decodings[0]] if a["prompt"] == name])
        cells = [
            f"{base / median([ms_per_token(a) for a in answers[d] if a['prompt'] == name]):.2f}x"
            for d in decodings[1:]
        ]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def ms_per_token(a: dict[str, Any]) -> float:
    """First to last streamed chunk over the tokens after the first."""
    return 1000 * (a["times"][-1] - a["times"][0]) / max(a["usage"]["completion_tokens"] - 1, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", default="3,4", help="ring sizes, comma-separated")
    p.add_argument(
        "--delays", default="0,5,20,40", help="one-way delays per edge in ms (the first is the reference)"
    )
    p.add_argument("--loss", default="20:0.01", help="DELAY_MS:LOSS conditions with loss, comma-separated")
    p.add_argument("--runs", type=int, default=3, help="requests per prompt and condition")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument(
        "--decodings",
        default="plain",
        help="how the heads decode, comma-separated, the first the one others are compared with: plain "
        "(--draft none), lookup (prompt lookup), model (--draft-model drafts), ahead (lookup with "
        "--draft-ahead 1)",
    )
    p.add_argument(
        "--spec", action="store_true", help="plain, lookup and model side by side: overrides --decodings"
    )
    p.add_argument(
        "--draft-model",
        default="smollm2-135m-gguf",
        help="the draft model of the `model` decoding (default: the served model's own Q4_1 GGUF)",
    )
    p.add_argument(
        "--hops", action="store_true", help="per answer: circuit, stages' compute, hops' paths and RTTs"
    )
    args = p.parse_args()
    reason = missing_requirements()
    if reason:
        sys.exit(reason)
    conditions = [(float(d), 0.0) for d in args.delays.split(",")]
    conditions += [(float(d), float(x)) for d, x in (c.split(":") for c in args.loss.split(",") if c)]
    now = datetime.datetime.now(datetime.UTC)
    print(f"benchmarks/wan.py {' '.join(sys.argv[1:])}; {now:%Y-%m-%d %H:%M} UTC; {os.cpu_count()} CPUs")
    decodings = ["plain", "lookup", "model"] if args.spec else args.decodings.split(",")
    unknown = [d for d in decodings if d not in DECODINGS]
    if unknown:
        sys.exit(f"--decodings: {', '.join(unknown)} unknown; choose from {', '.join(DECODINGS)}")
    for members in (int(m) for m in args.members.split(",")):
        asyncio.run(ring(members, conditions, decodings, args))


if __name__ == "__main__":
    main()
