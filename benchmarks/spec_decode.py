"""Speculative decoding with prompt lookup against plain decoding, one user, a ring of three;
with `--ahead N` also prompt lookup drafting ahead (N steps in the ring past the one verified).

Three stages of the default model (smollm2-135m, fp32, CPU) in this process, each on its own
model thread, joined by in-memory channels that hold every message for a simulated one-way hop
delay (`--hop-ms`, default 20: homes 20 ms apart; the issue's WAN lab measures real links). The
head drafts (`--draft lookup`), drafts ahead (`--draft-ahead N`) or not (`none`); everything
else is the session's own code (RingHead, RingMember, Heartbeat, the tensor frames encoded as on
a link).

Three prompts, greedy: a chat question, a summary of a given text, and an edit of given code.
Every mode's ring is built first and the modes alternate request by request, so they share the
machine's load. For each prompt: ms per token over the decode (first token to last), tokens per
circuit and drafted / kept tokens, as medians over `--runs` runs with their spread (min-max), the
answers of every mode compared token for token with plain decoding's, and the load average
before and after. Drafting ahead also reports the rows its steps carried over lookup's (the
extra compute every stage spent) and the steps ahead sent and voided.

    python3 benchmarks/spec_decode.py [--hop-ms 20] [--tokens 64] [--runs 3] [--ahead 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from kafila.api.service import Sampling
from kafila.engine.draft import policy_for
from kafila.engine.stage import Stage
from kafila.engine.tokenizer import Tokenizer
from kafila.models.checkpoint import Checkpoint
from kafila.models.registry import resolve
from kafila.session.channel import Heartbeat, MemoryChannel
from kafila.session.ring.compute import ModelThread
from kafila.session.ring.head import RingHead
from kafila.session.ring.info import RingInfo
from kafila.session.ring.member import RingMember

TEXT = (
    "The river town of Alder Bend grew up around a ferry crossing in the eighteenth century. "
    "When the railway bridge opened in 1889, the ferry closed, and the town's market moved from "
    "the riverbank to the station square. Today the old ferry house is a museum, the station "
    "square still holds a market every Saturday, and the bridge carries both trains and a "
    "footpath that walkers use to reach the hills on the far bank."
)
CODE = """def total_price(items):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    return total


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
"""
PROMPTS = {
    "chat": "What should I pack for a weekend of hiking in the mountains?",
    "summary": f"Summarise this text in a few sentences, using its own words:\n\n{TEXT}",
    "code edit": f"Rename the function total_price to order_total in this code and show the code:\n\n{CODE}",
}


class DelayedChannel(MemoryChannel):
    """An in-memory channel end whose messages arrive `delay_s` after they are sent (a simulated
    one-way hop delay; order is kept, as every message waits the same)."""

    delay_s = 0.0

    async def send(self, msg: Any) -> None:
        if self.delay_s <= 0:
            await super().send(msg)
            return
        loop = asyncio.get_running_loop()
        loop.call_later(self.delay_s, lambda: asyncio.ensure_future(MemoryChannel.send(self, msg)))


def ring(
    ckpt: Checkpoint, splits: Sequence[tuple[int, int]], draft: str, hop_s: float, eos: Any, ahead: int = 0
) -> Any:
    """(head, members, channels) of a ring of `splits`, every hop delayed `hop_s` one way."""
    names = tuple(f"m{i}" for i in range(len(splits)))
    info = RingInfo(
        session="bench",
        model="smollm2-135m",
        division="bench",
        order=names,
        blocks=dict(zip(names, splits, strict=True)),
        predicted_ms={n: 1.0 for n in names},
        edges={f"{a}->{b}": "local" for a, b in zip(names, names[1:] + names[:1], strict=True)},
    )
    stages = [
        Stage.load(ckpt, range(a, b), i == 0, "torch", "fp32", context=1024)
        for i, (a, b) in enumerate(splits)
    ]
    n = len(splits)
    pairs = []
    DelayedChannel.delay_s = hop_s  # every hop alike
    for i in range(n):
        a, b = DelayedChannel.pair(names[i], names[(i + 1) % n])
        pairs.append((_beat(a), _beat(b)))
    head = RingHead(
        stages[0], ModelThread(names[0]), info, pairs[0][0], pairs[-1][1], tuple(eos), lanes=1,
        draft=policy_for(draft, ahead),
    )  # fmt: skip
    members = [
        RingMember(i, stages[i], ModelThread(names[i]), info, pairs[i][0], pairs[i - 1][1])
        for i in range(1, n)
    ]
    return head.start(), [m.start() for m in members], [c for p in pairs for c in p]


Run = tuple[list[int], float, int, int, int, int, int, int]


async def one(head: RingHead, prompt: list[int], tokens: int) -> Run:
    """(answer, ms per token after the first, circuits, drafted, kept, decode rows sent, steps sent
    ahead, steps voided) of one greedy request."""
    rows, sent, voided = head.decode_rows, head.drafted_ahead, head.voided_ahead
    gen = await head.submit(prompt, Sampling(max_tokens=tokens))
    out: list[int] = []
    first, last = None, 0.0
    async for ev in gen:
        if ev.tokens:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            out.extend(ev.tokens)
    circuits, drafted, kept = head.last_request
    ms = (last - (first or last)) * 1e3 / max(len(out) - 1, 1)
    ahead = (head.decode_rows - rows, head.drafted_ahead - sent, head.voided_ahead - voided)
    return out, ms, circuits, drafted, kept, *ahead


async def run(args: argparse.Namespace) -> int:
    ckpt = Checkpoint.open(resolve("smollm2-135m"), complete=True)
    tok = Tokenizer.from_checkpoint(ckpt)
    n = ckpt.n_blocks
    splits = [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]
    results: dict[tuple[str, str], list[Run]] = {}
    modes = {"none": ("none", 0), "lookup": ("lookup", 0)}
    if args.ahead:
        modes["ahead"] = ("lookup", args.ahead)
    rings = {
        mode: ring(ckpt, splits, draft, args.hop_ms / 1e3, tok.stop_ids, ahead)
        for mode, (draft, ahead) in modes.items()
    }
    load_before = os.getloadavg()
    try:
        for _ in range(args.runs):  # the modes alternate, so both see the same load
            for name, text in PROMPTS.items():
                prompt = tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
                for mode, (head, _, _) in rings.items():
                    results.setdefault((name, mode), []).append(await one(head, prompt, args.tokens))
    finally:
        for head, members, channels in rings.values():
            await head.stop()
            for m in members:
                await m.stop()
            for c in channels:
                await c.close()
    load = os.getloadavg()
    print(
        f"three stages of smollm2-135m fp32, simulated one-way hop {args.hop_ms:g} ms, greedy, "
        f"{args.tokens} tokens"
    )
    print(
        f"load average (1, 5, 15 min) before {_loads(load_before)}, after {_loads(load)}; "
        f"medians of {args.runs} runs (min-max)"
    )
    for name in PROMPTS:
        plain, spec = results[(name, "none")], results[(name, "lookup")]
        same = all(a[0] == b[0] for a, b in zip(plain, spec, strict=True))
        print(
            f"{name:10s} plain {_fig([r[1] for r in plain])} ms/token, lookup {_fig([r[1] for r in spec])} "
            f"ms/token ({_ratio(plain, spec):.2f}x); "
            f"tokens/circuit {statistics.median((len(r[0]) - 1) / max(r[2], 1) for r in spec):.2f}; "
            f"kept {sum(r[4] for r in spec)}/{sum(r[3] for r in spec)} drafted; answers identical: {same}"
        )
        if "ahead" not in modes:
            continue
        ahead = results[(name, "ahead")]
        same = all(a[0] == b[0] for a, b in zip(plain, ahead, strict=True))
        rows = sum(r[5] for r in ahead) / max(sum(r[5] for r in spec), 1)
        print(
            f"{'':10s} ahead {args.ahead}: {_fig([r[1] for r in ahead])} ms/token "
            f"({_ratio(plain, ahead):.2f}x plain, {_ratio(spec, ahead):.2f}x lookup); "
            f"tokens/circuit {statistics.median((len(r[0]) - 1) / max(r[2], 1) for r in ahead):.2f}; "
            f"kept {sum(r[4] for r in ahead)}/{sum(r[3] for r in ahead)} drafted; "
            f"steps ahead {sum(r[6] for r in ahead)}, voided {sum(r[7] for r in ahead)}; "
            f"rows {rows:.2f}x lookup's; answers identical: {same}"
        )
    return 0


def _loads(loads: tuple[float, float, float]) -> str:
    return " ".join(f"{x:.1f}" for x in loads)


def _beat(channel: MemoryChannel) -> Heartbeat:
    return Heartbeat(channel, 30.0, first_within=30.0).start()


def _ratio(plain: list[Any], spec: list[Any]) -> float:
    return statistics.median(r[1] for r in plain) / statistics.median(r[1] for r in spec)


def _fig(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hop-ms", type=float, default=20.0, help="simulated one-way delay per hop (default 20)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per answer (default 64)")
    p.add_argument("--runs", type=int, default=3, help="runs of each prompt and mode (default 3)")
    p.add_argument(
        "--ahead", type=int, default=1, help="steps lookup drafts ahead in a third mode (default 1; 0: none)"
    )
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
