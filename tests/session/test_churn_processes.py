"""Membership that changes again and again while the session serves, as processes on loopback
(`kafila host`, `kafila join`): a loss, the lost member back under its name, a newcomer, another
loss, another newcomer, another loss. After each change, once the session serves again, every
member in the ring answers the same greedy question as the head did before any change, within
90 s; a request through a member that arrived mid-session used to hang for good when its ring
index was a survivor's first one (the survivor took its answers as its own). Each loss takes the
ring member right after the head (neither head nor host), so the survivors behind it move up and
a member planned in later lands on a survivor's first index; where the plan put the newcomers
elsewhere (the ring's order decides), a newcomer and a loss follow, at most twice, and the test
checks that a member landed so.
Members the host keeps as spares answer too: their API relays to the host's.

A second test makes a spare on purpose (a member five times slower, which no plan gains from)
and asks it on every route; a loss then makes the host plan it in (no survivor holds the model
alone) while an answer streams through it, which completes unchanged."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kafila.demo.fleet import FleetMember, LocalFleet

pytestmark = [
    pytest.mark.network,
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # forming and six changes, each a re-plan or a join that probes and loads
]
MODEL = "smollm2-135m"
QUESTION = "List ten facts about owls."
ANSWER_S = 90.0  # a member's answer, once the session serves again
SETTLE_S = 300.0  # a change (a join probes, fetches and loads) until the session serves again
# Whether the slow member waits as a spare is decided by a margin (5%) on the members' measured
# speeds: each member measures as this test starts, beside the others, rather than offering a
# measurement an earlier test made under another load (--probe-max-age).
MEASURE_NOW = ("--probe-max-age", "0")


def _greedy(url: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24, "temperature": 0}  # fmt: skip
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=ANSWER_S)
    if r.status_code != 200:
        raise AssertionError(f"HTTP {r.status_code}: {r.text[:300]}")
    return str(r.json()["choices"][0]["message"]["content"])


def _session(member: FleetMember) -> dict[str, Any] | None:
    try:
        r = httpx.get(f"{member.api_url}/session", timeout=10)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def _alive(fleet: LocalFleet) -> list[FleetMember]:
    return [m for m in fleet.members if m.proc is not None and m.proc.poll() is None and m.api_url]


def _settled(fleet: LocalFleet, gone: set[str], what: str) -> dict[str, Any]:
    """The host's /session once the session serves with every live member in the ring or a spare,
    none of `gone` in the ring, and each ring member serving the host's epoch itself."""
    deadline, last = time.monotonic() + SETTLE_S, "nothing yet"
    while time.monotonic() < deadline:
        doc = _session(fleet.members[0])
        if doc is None or doc["state"] != "serving":
            last = f"host: {doc and doc['state']}"
        elif gone & set(doc["ring"]):
            last = f"{sorted(gone & set(doc['ring']))} still in the ring {doc['ring']}"
        elif waiting := [
            m.name for m in _alive(fleet) if m.name not in [*doc["ring"], *doc.get("spares", [])]
        ]:
            last = f"{waiting} neither in the ring {doc['ring']} nor spares {doc.get('spares')}"
        else:
            views = {m.name: _session(m) for m in _alive(fleet) if m.name in doc["ring"]}
            behind = {n: v and (v["state"], v["epoch"]) for n, v in views.items()
                      if v is None or v["state"] != "serving" or v["epoch"] != doc["epoch"]}  # fmt: skip
            if not behind:
                return doc
            last = f"members not serving epoch {doc['epoch']}: {behind}"
        time.sleep(0.5)
    raise AssertionError(f"after {what}: the session did not settle within {SETTLE_S:g} s ({last})")


def _victim(fleet: LocalFleet, doc: dict[str, Any]) -> FleetMember:
    """The ring member right after the head that is not the host: its loss moves the ones behind up."""
    ring, host = doc["ring"], fleet.members[0].name
    name = next(n for n in ring[ring.index(doc["head"]) + 1 :] + ring if n not in (doc["head"], host))
    return next(m for m in fleet.members if m.name == name)


def test_every_members_api_answers_through_a_run_of_losses_returns_and_newcomers(
    smollm2_path: Path, tmp_path: Path
) -> None:
    args = ("--dead-after", "3", "--threads", "1")  # one thread each: up to five members on 2 cores
    started = time.monotonic()
    with LocalFleet((None,) * 4, MODEL, context=512, concurrency=2, workdir=tmp_path, stagger=False,
                    extra_args=args) as fleet:  # fmt: skip
        doc = _settled(fleet, set(), "forming")
        expected = _greedy(fleet.url(doc["head"]))
        first: dict[str, int] = {n: i for i, n in enumerate(doc["ring"])}  # live members' first index
        landed: list[str] = []  # members planned in at a live survivor's first index
        gone: set[str] = set()
        changes = ["loss", "back", "new epsilon", "loss", "new zeta", "loss"]
        spare_changes = ["new eta", "loss", "new theta", "loss"]  # until one lands (ring order decides)
        lost_first: FleetMember | None = None
        n = 0
        while n < len(changes):
            change, n = changes[n], n + 1
            if change == "loss":
                victim = _victim(fleet, doc)
                assert victim.proc is not None
                victim.proc.send_signal(signal.SIGKILL)
                victim.proc.wait(30)
                gone = {victim.name}
                first.pop(victim.name, None)
                lost_first = lost_first or victim
                if victim is not lost_first:  # gone for good: the fleet's checks leave it out
                    fleet.members.remove(victim)
                what = f"change {n}, {victim.name} lost"
            else:
                name = lost_first.name if change == "back" and lost_first else change.split()[1]
                fleet.add_member(name, wait_s=SETTLE_S)
                gone = set()
                what = f"change {n}, {name} {'back' if change == 'back' else 'joined'}"
            doc = _settled(fleet, gone, what)
            for i, name in enumerate(doc["ring"]):
                if name not in first:  # built in this epoch: its index, and who had it first
                    if any(first[s] == i for s in first if s != doc["head"]):
                        landed.append(f"{name} at {i} in epoch {doc['epoch']} ({what})")
                    first[name] = i
            failures = []
            for m in _alive(fleet):  # spares too: they relay to the host
                t0 = time.monotonic()
                try:
                    got = _greedy(str(m.api_url))
                except (AssertionError, httpx.HTTPError) as exc:
                    failures.append(f"{m.name}: {exc!r} after {time.monotonic() - t0:.0f} s")
                    continue
                if got != expected:
                    failures.append(f"{m.name}: answered {got!r}, not {expected!r}")
            assert not failures, f"after {what} (ring {doc['ring']}, epoch {doc['epoch']}): {failures}"
            if n == len(changes) and not landed and spare_changes:
                changes += [spare_changes.pop(0), spare_changes.pop(0)]
        assert landed, f"no member was planned in at a survivor's first index (first indexes {first})"
    print(f"churn: {len(changes)} changes in {time.monotonic() - started:.0f} s; landed: {landed}")


def _streamed(url: str, max_tokens: int, first: threading.Event | None = None) -> str:
    """A greedy answer streamed (SSE); sets `first` once its first text arrived."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}  # fmt: skip
    out: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=SETTLE_S) as r:
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
                if first is not None and "".join(out):
                    first.set()
    return "".join(out)


def test_a_spare_answers_through_the_host_then_through_its_own_role_once_planned_in(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """Two members and a third that runs at a fifth of a CPU (--emulate-speed 0.2): no plan with it
    is faster, so the host keeps it as a spare. Every member offers 0.35 GB (--memory-gb), less
    than the fp32 model (0.54 GB), so after a loss the survivor cannot hold it alone and the host
    plans the spare in. The spare answers OpenAI and Ollama, collected and streamed, as the head
    does, and the head's records name it as the member that asked; an answer streaming through it
    when the other member is killed completes unchanged, and so do its answers afterwards, through
    its own ring role."""
    small = ("--memory-gb", "0.35", *MEASURE_NOW)
    with LocalFleet((None,) * 2, MODEL, context=512, concurrency=2, workdir=tmp_path, stagger=False,
                    extra_args=("--dead-after", "3", "--threads", "1", *small)) as fleet:  # fmt: skip
        doc = _settled(fleet, set(), "forming")
        head = doc["head"]
        expected, longer = _greedy(fleet.url(head)), _streamed(fleet.url(head), 64)
        spare = fleet.add_member("slow", ("--emulate-speed", "0.2"), wait_s=SETTLE_S)
        doc = _settled(fleet, set(), "slow joined")
        assert doc["spares"] == ["slow"], doc
        url = str(spare.api_url)
        mine = _session(spare)
        assert mine is not None and (mine["state"], mine["host"]) == ("spare", fleet.members[0].name), mine
        assert _greedy(url) == expected and _streamed(url, 24) == expected
        chat = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "stream": False,
                "options": {"temperature": 0, "num_predict": 24}}  # fmt: skip
        ollama = httpx.post(f"{url}/api/chat", json=chat, timeout=ANSWER_S).json()
        assert ollama["message"]["content"] == expected, ollama
        deadline, asked = time.monotonic() + 30, []
        while asked.count("slow") < 3 and time.monotonic() < deadline:  # written as each free comes back
            asked = [r["member"] for r in fleet.traces(head) if r.get("type") == "request"]
            time.sleep(0.5)
        assert asked.count("slow") == 3, asked  # the head names the spare, not the host that relayed

        first, answers = threading.Event(), []
        streaming = threading.Thread(target=lambda: answers.append(_streamed(url, 64, first)))
        streaming.start()
        assert first.wait(ANSWER_S), "no text streamed through the spare"
        victim = next(m for m in fleet.members if m.name in doc["ring"] and m is not fleet.members[0])
        assert victim.proc is not None  # the ring member besides the host (the head, or not)
        victim.proc.send_signal(signal.SIGKILL)
        streaming.join(SETTLE_S)
        assert answers == [longer], "the answer streaming through the spare changed across the re-plan"
        doc = _settled(fleet, {victim.name}, f"{victim.name} lost")
        assert "slow" in doc["ring"] and not doc["spares"], doc
        own = _session(spare)
        assert own is not None and own["state"] == "serving" and own["me"] == "slow", own
        assert _greedy(url) == expected  # through its own role now


def test_a_spare_of_a_killed_host_joins_its_successor_and_answers_on_the_same_address(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """The host keeps a member twenty times slower as a spare, then the host is killed (SIGKILL; it
    offers 0.1 GB, so the head is the other member). The other member takes over as the host, and
    the spare, told by the rendezvous that its host left, joins again with the same code on the
    same API address, offering the measurement it made moments before: the successor keeps it as
    its own spare, and the greedy answer through that address is the one from before. It used to
    end with its host."""
    with LocalFleet((None,) * 2, MODEL, context=512, concurrency=2, workdir=tmp_path, stagger=False,
                    extra_args=("--dead-after", "3", "--threads", "1", *MEASURE_NOW),
                    member_args=[("--memory-gb", "0.1"), ()]) as fleet:  # fmt: skip
        doc = _settled(fleet, set(), "forming")
        host, heir = fleet.members
        assert doc["head"] == heir.name, doc
        expected = _greedy(fleet.url(heir.name))
        spare = fleet.add_member("slow", ("--emulate-speed", "0.05"), wait_s=SETTLE_S)
        doc = _settled(fleet, set(), "slow joined")
        assert doc["spares"] == ["slow"], doc
        url = str(spare.api_url)
        assert host.proc is not None and spare.proc is not None
        host.proc.send_signal(signal.SIGKILL)
        deadline, mine = time.monotonic() + SETTLE_S, _session(spare)
        while not (mine and mine.get("state") == "spare" and mine.get("host") == heir.name):
            assert spare.proc.poll() is None, f"the spare ended: {spare.log_text()[-2000:]}"
            assert time.monotonic() < deadline, f"not the successor's spare: {mine}"
            time.sleep(0.5)
            mine = _session(spare)
        log = spare.log_text()
        said = "left while it kept this member as a spare; joining again with the same code"
        assert said in log, log[-2000:]
        again = log[log.index(said) :]  # joining again: not measured again
        assert "measuring this device" not in again, again[-2000:]
        assert "slow: measured" in again and "offering that measurement" in again, again[-2000:]
        assert _session(heir)["spares"] == ["slow"]  # type: ignore[index]
        assert _greedy(url) == expected  # relayed to the successor's API
