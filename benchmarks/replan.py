"""A member lost mid-answer: how soon the answer resumes, and how many weight bytes the re-plan moved.

Four member processes on loopback (`kafila host` + three `kafila join`, the default model). Every
joining member has a weight cache of its own (KAFILA_CACHE), so it fetches its shard from the host at
forming, and at the re-plan fetches only the tensors its new share adds (its cache holds the rest).
One greedy answer streams from the head; after --kill-at tokens a member that is neither the head
nor the host is killed with SIGKILL. The three survivors re-plan (kafila.session.forming.epochs)
and the answer goes on.

Printed, from one run:
- loss -> first resumed token: from the SIGKILL to the next token the client reads (detection by the
  ring's heartbeats, --dead-after, included); target <= 5 s;
- detection -> every survivor ready, from the host's trace (its `replan` record);
- bytes fetched (what the host served for the re-plan: tensors, plus any header ranges) against the
  minimum the new division needs the survivors to fetch (kafila.planner.replan `Replan.fetches`
  of every member but the host, which loads its own new blocks from its checkpoint); target: equal;
- whether the answer equals the same request's answer without the kill.

    python3 benchmarks/replan.py [--tokens 120] [--kill-at 20] [--dead-after 3]
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
from pathlib import Path

import httpx
from _session_common import LocalFleet

MODEL = "smollm2-135m"
PROMPT = "Tell me a long story about a lighthouse keeper and a storm."


def stream(
    url: str, tokens: int, kill_at: int | None = None, victim: object = None
) -> tuple[str, float | None]:
    """The answer's text, and (with `kill_at`) seconds from the kill to the first token after the
    pause (the token after the longest gap between two tokens once the member was killed: tokens
    already on their way when it died arrive before the pause)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": tokens, "temperature": 0, "stream": True}  # fmt: skip
    parts: list[str] = []
    killed_at: float | None = None
    after: list[float] = []  # arrival times of the tokens read after the kill
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the answer failed: {chunk['error']}")
            parts.append(chunk["choices"][0]["delta"].get("content") or "")
            if killed_at is not None:
                after.append(time.monotonic())
            if kill_at is not None and len(parts) == kill_at:
                victim.proc.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
                killed_at = time.monotonic()
    if killed_at is None or not after:
        return "".join(parts), None
    times = [killed_at, *after]
    gap = max(range(1, len(times)), key=lambda i: times[i] - times[i - 1])
    return "".join(parts), times[gap] - killed_at


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=120, help="tokens the answer streams (default 120)")
    p.add_argument("--kill-at", type=int, default=20, help="kill the member after this many (default 20)")
    p.add_argument("--dead-after", type=float, default=3.0, help="members' --dead-after (default 3 s)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kafila-replan-"))
    caches: list[dict[str, str]] = [{}] + [{"KAFILA_CACHE": str(work / f"cache{i}")} for i in range(1, 4)]
    fleet = LocalFleet((None,) * 4, MODEL, context=512, workdir=work / "fleet", stagger=False,
                       extra_args=("--dead-after", f"{args.dead_after:g}"), member_env=caches)  # fmt: skip
    with fleet:  # started here
        doc = fleet.session()
        head = next(m for m in fleet.members if m.name == doc["head"])
        victim = next(m for m in fleet.members[1:] if m.name != doc["head"])
        assert head.api_url is not None
        ring = " -> ".join(doc["ring"])
        print(f"ring {ring}, head {head.name}; killing {victim.name} at token {args.kill_at}")
        expected, _ = stream(head.api_url, args.tokens)
        got, resumed = stream(head.api_url, args.tokens, args.kill_at, victim)
        host = fleet.members[0].name
        deadline = time.monotonic() + 15
        records: list[dict[str, object]] = []
        while not records and time.monotonic() < deadline:
            records = [r for r in fleet.traces(host) if r.get("type") == "replan"]
            time.sleep(0.2)
        after = fleet.session()
    if not records:
        print("no re-plan record in the host's trace")
        return 1
    rec = records[0]
    fetched, minimum = int(rec["bytes_fetched"]), int(rec["bytes_minimum"])  # type: ignore[call-overload]
    print(f"old division: {rec['old_blocks']}")
    print(f"new division: {rec['new_blocks']} (epoch {after['epoch']}, state {after['state']})")
    ok_time = resumed is not None and resumed <= 5.0
    print(
        f"loss -> first resumed token: {resumed:.2f} s (target <= 5 s: {'yes' if ok_time else 'no'})"
        if resumed is not None
        else "loss -> first resumed token: none (the answer ended before the loss)"
    )
    print(f"detection -> every survivor ready: {float(rec['ready_s']):.2f} s (host's trace)")  # type: ignore[arg-type]
    if rec.get("first_token_s") is not None:
        print(f"detection -> first resumed token at the head: {float(rec['first_token_s']):.2f} s")  # type: ignore[arg-type]
    ratio = f"{fetched / minimum:.3f}x" if minimum else "nothing to fetch (only the host's share grew)"
    print(
        f"bytes fetched {fetched / 1e6:.2f} MB against the minimum {minimum / 1e6:.2f} MB: {ratio} "
        f"(target 1.000x: {'yes' if fetched == minimum else 'no'})"
    )
    print(f"answer identical to the one without the kill: {'yes' if got == expected else 'no'}")
    return 0 if got == expected else 1


if __name__ == "__main__":
    raise SystemExit(main())
