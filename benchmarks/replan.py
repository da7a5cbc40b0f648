"""A member lost mid-answer: how soon the answer resumes, and how many weight bytes the re-plan moved.

Four member processes on loopback (`kafila host` + three `kafila join`, the default model). Every
joining member has a weight cache of its own (KAFILA_CACHE), so it fetches its shard from the host at
forming, and at the re-plan fetches only the tensors its new share adds (its cache holds the rest).
One greedy answer streams; after --kill-at tokens a member is killed with SIGKILL. With
`--lose member` (the default) it is one that is neither the head nor the host, and the answer
streams from the head. With `--lose head` the host offers 0.1 GB (--memory-gb: less than the
head's 0.11 GB of fp32 tensors, so the planner puts the head on a joining member), the head is
killed, and the answer streams through the host, which sends the request to the new head with the
tokens it has streamed (kafila.session.ring.promote). With `--lose host` the host offers 0.1 GB
too (so it is not the head), the host is killed, and the answer streams from the head: the first
member of the host's succession order takes over as the session's host
(kafila.session.forming.takeover) and re-plans. Every member then loads from its own copy of the
checkpoint (no KAFILA_CACHE of its own: the successor serves no weights), so nothing is fetched
over a link; the minimum is what the survivors would have had to fetch. The three survivors
re-plan (kafila.session.forming.epochs) and the answer goes on. `--runs N` repeats it on N new
sessions and prints the median pause.

Printed, from one run:
- loss -> first resumed token: from the SIGKILL to the next token the client reads (detection by the
  ring's heartbeats, --dead-after, included); target <= 5 s losing a member, <= 8 s losing the
  head (its tensors move to the new head) or the host;
- detection -> every survivor ready, from the coordinator's trace (its `replan` record: the host's,
  or with `--lose host` its successor's);
- bytes fetched (what the host served for the re-plan: tensors, plus any header ranges) against the
  minimum the new division needs the survivors to fetch (kafila.planner.replan `Replan.fetches`
  of every member but the host, which loads its own new blocks from its checkpoint); target: no more
  (each member also keeps the next one's shard on disk and loads from there what it holds, so a
  loss usually fetches less than the minimum);
- whether the answer equals the same request's answer without the kill.

    python3 benchmarks/replan.py [--lose member|head|host] [--runs 1] [--tokens 120] [--kill-at 20]
                                 [--dead-after 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
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


TARGET_S = {"member": 5.0, "head": 8.0, "host": 8.0}  # loss -> first resumed token


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lose", choices=tuple(TARGET_S), default="member", help="whom to kill (default member)")
    p.add_argument("--runs", type=int, default=1, help="sessions to run it on (default 1)")
    p.add_argument("--tokens", type=int, default=120, help="tokens the answer streams (default 120)")
    p.add_argument("--kill-at", type=int, default=20, help="kill the member after this many (default 20)")
    p.add_argument("--dead-after", type=float, default=3.0, help="members' --dead-after (default 3 s)")
    args = p.parse_args()
    pauses, ok = [], True
    for run in range(args.runs):
        if args.runs > 1:
            print(f"run {run + 1} of {args.runs}")
        resumed, same = one_run(args)
        ok = ok and same and resumed is not None
        if resumed is not None:
            pauses.append(resumed)
    if args.runs > 1 and pauses:
        target = TARGET_S[args.lose]
        median = statistics.median(pauses)
        print(
            f"loss -> first resumed token over {len(pauses)} runs: median {median:.2f} s "
            f"({', '.join(f'{x:.2f}' for x in pauses)}; "
            f"target <= {target:g} s: {'yes' if median <= target else 'no'})"
        )
    return 0 if ok else 1


def one_run(args: argparse.Namespace) -> tuple[float | None, bool]:
    """One session: the pause from the kill to the next token, and whether the answer was unchanged.
    Its members' caches and logs (about 1.3 GB) are removed after it."""
    work = Path(tempfile.mkdtemp(prefix="kafila-replan-"))
    try:
        return _measured(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measured(args: argparse.Namespace, work: Path) -> tuple[float | None, bool]:
    head_lost, host_lost = args.lose == "head", args.lose == "host"
    own = [{"KAFILA_CACHE": str(work / f"cache{i}")} for i in range(1, 4)]
    caches: list[dict[str, str]] = [{}] + ([{}, {}, {}] if host_lost else own)
    limits = [("--memory-gb", "0.1"), (), (), ()] if head_lost or host_lost else None  # the head off the host
    fleet = LocalFleet((None,) * 4, MODEL, context=512, workdir=work / "fleet", stagger=False,
                       extra_args=("--dead-after", f"{args.dead_after:g}"), member_env=caches,
                       member_args=limits)  # fmt: skip
    with fleet:  # started here
        doc = fleet.session()
        head = next(m for m in fleet.members if m.name == doc["head"])
        host = fleet.members[0]
        victim = head if head_lost else next(m for m in fleet.members[1:] if m.name != doc["head"])
        victim = host if host_lost else victim
        client = host if head_lost else head  # streams through a member that survives
        assert client.api_url is not None
        if (head_lost or host_lost) and head is host:
            raise SystemExit("the planner put the head on the host; nothing to measure")
        coordinator = doc["succession"][0] if host_lost else host.name  # who re-plans
        ring = " -> ".join(doc["ring"])
        print(f"ring {ring}, head {head.name}; killing {victim.name} at token {args.kill_at}")
        expected, _ = stream(client.api_url, args.tokens)
        got, resumed = stream(client.api_url, args.tokens, args.kill_at, victim)
        deadline = time.monotonic() + 15
        records: list[dict[str, object]] = []
        while not records and time.monotonic() < deadline:
            records = [r for r in fleet.traces(coordinator) if r.get("type") == "replan"]
            time.sleep(0.2)
        after = fleet.session(coordinator)
    if not records:
        print(f"no re-plan record in {coordinator}'s trace")
        return resumed, False
    rec = records[0]
    fetched, minimum = int(rec["bytes_fetched"]), int(rec["bytes_minimum"])  # type: ignore[call-overload]
    print(f"old division: {rec['old_blocks']}")
    print(
        f"new division: {rec['new_blocks']} "
        f"(epoch {after['epoch']}, state {after['state']}, head {after['head']})"
    )
    target = TARGET_S[args.lose]
    ok_time = resumed is not None and resumed <= target
    print(
        f"loss -> first resumed token: {resumed:.2f} s (target <= {target:g} s: {'yes' if ok_time else 'no'})"
        if resumed is not None
        else "loss -> first resumed token: none (the answer ended before the loss)"
    )
    print(f"detection -> every survivor ready: {float(rec['ready_s']):.2f} s ({coordinator}'s trace)")  # type: ignore[arg-type]
    if rec.get("first_token_s") is not None:
        print(f"detection -> first resumed token at the head: {float(rec['first_token_s']):.2f} s")  # type: ignore[arg-type]
    ratio = f"{fetched / minimum:.3f}x" if minimum else "nothing to fetch (only the host's share grew)"
    if host_lost and fetched == 0:
        ratio = "nothing moved over a link: every survivor loaded its new blocks from its own copy"
    target_bytes = (
        ""
        if host_lost and fetched == 0
        else f" (target <= 1.000x: {'yes' if fetched <= minimum else 'no'}; the replicas each member keeps "
        "on disk supply what it does not fetch)"
    )
    print(
        f"bytes fetched {fetched / 1e6:.2f} MB against the minimum {minimum / 1e6:.2f} MB: "
        f"{ratio}{target_bytes}"
    )
    print(f"answer identical to the one without the kill: {'yes' if got == expected else 'no'}")
    return resumed, got == expected


if __name__ == "__main__":
    raise SystemExit(main())
