"""Losing a member, with real processes on loopback (`kafila rendezvous`, `host`, `join`; the
default offline model): who is named, with which cause, how fast, and what a frozen member says
when it runs again. The ring's bound is the default (`--lost-after` 3 s)."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import pytest

from kafila.demo.fleet import FleetMember, LocalFleet
from kafila.session.channel import DEFAULT_LOST_AFTER

pytestmark = [pytest.mark.network, pytest.mark.slow]
MODEL = "smollm2-135m"
ASK = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture
def fleet(smollm2_path, tmp_path):
    with LocalFleet((None, None, None), MODEL, context=512, workdir=tmp_path, stagger=False,
                    extra_args=("--threads", "1")) as f:  # fmt: skip
        yield f


def victim_of(fleet: LocalFleet) -> tuple[FleetMember, FleetMember]:
    """(the head, a member that is neither the head nor the host, whose ending ends the session)."""
    head = fleet.session()["head"]
    victim = next(m for m in fleet.members[1:] if m.name != head)
    assert victim.proc is not None
    return next(m for m in fleet.members if m.name == head), victim


def lost_within(m: FleetMember, since: float, seconds: float) -> tuple[float, dict[str, Any]]:
    """(seconds from `since` until `m`'s /session counted a member lost: re-planning, or already in
    the next epoch; the document); fails after `seconds`."""
    while True:
        doc = httpx.get(f"{m.api_url}/session", timeout=5).json()
        took = time.monotonic() - since
        if doc["state"] != "serving" or doc.get("epoch", 1) > 1:
            return took, doc
        assert took < seconds, f"{m.name} still says {doc['state']} {took:.1f} s on"
        time.sleep(0.02)


def test_a_killed_member_is_named_at_once_by_the_rendezvous_notice_within_the_bound(
    fleet: LocalFleet,
) -> None:
    """kill -9 of a non-head member: the rendezvous says `member_left ... disconnected` within ms;
    once the member's link stayed silent for 0.75 s the head counts it lost naming it and that
    cause (and re-plans around it), before the heartbeat's 3 s would."""
    head, victim = victim_of(fleet)
    assert victim.proc is not None
    victim.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    took, doc = lost_within(head, killed, DEFAULT_LOST_AFTER)
    cause = (doc.get("change") or {}).get("cause", "")
    print(f"the head {head.name} named the killed member {victim.name} {took:.2f} s after kill -9: {cause}")
    assert f"member {victim.name} lost its connection (disconnected), the rendezvous says" in cause, doc
    assert took < DEFAULT_LOST_AFTER - 1.0, f"{took:.2f} s: the heartbeat bound, not the rendezvous notice"
    for m in fleet.members:  # every survivor names the same member
        if m is not victim:
            _, doc = lost_within(m, time.monotonic(), 10)
            assert victim.name in (doc.get("change") or {}).get("cause", ""), (m.name, doc.get("change"))


STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
LONG = {"model": MODEL, "messages": STORY, "max_tokens": 400, "temperature": 0}


def _ask(url: str, body: dict[str, Any], out: dict[str, Any], chunks: threading.Event | None = None) -> None:
    """One answer from `url` (streamed when `chunks` is given, set once 3 chunks came): its status
    and error, and when it ended (a hang shows as no "at")."""
    try:
        if chunks is None:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            out.update(status=r.status_code, error=r.json().get("error"))
        else:
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=120
            ) as r:
                out["status"], n = r.status_code, 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        out["error"] = chunk.get("error")
                        n += 1
                        if n == 3:
                            chunks.set()
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)  # a reset or a timeout: what must not happen
    out["at"] = time.monotonic()


def test_a_member_frozen_past_the_bound_is_named_and_says_so_when_it_resumes(fleet: LocalFleet) -> None:
    """SIGSTOP for 8 s (the bound is 3), then SIGCONT. The head counts it lost by its silence
    within the bound (and re-plans around it); on waking it says that it was itself counted lost,
    never blaming a neighbour (it used to say "link to gamma closed by the peer"), and ends. The
    requests its own API had forwarded (one streaming, one queued behind it) fail at once on
    waking: a 503, or an error chunk in the stream already answering 200, saying that the session
    goes on without it and on which members; never a hang or a reset."""
    head, victim = victim_of(fleet)
    assert victim.proc is not None and victim.api_url is not None
    streamed: dict[str, Any] = {}
    whole: dict[str, Any] = {}
    chunks = threading.Event()
    asks = [
        threading.Thread(target=_ask, args=(victim.api_url, LONG, streamed, chunks)),
        threading.Thread(target=_ask, args=(victim.api_url, LONG, whole)),
    ]
    asks[0].start()  # the streamed answer first, then the other queued behind it (started
    assert chunks.wait(120), streamed  # together, either may reach the head first)
    asks[1].start()
    deadline = time.monotonic() + 30
    while victim.log_text().count("request_forwarded") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.proc.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        took, doc = lost_within(head, stopped, DEFAULT_LOST_AFTER + 2.0)
        cause = (doc.get("change") or {}).get("cause", "")
        print(f"the head {head.name} counted the frozen member {victim.name} lost {took:.2f} s after SIGSTOP")
        assert f"member {victim.name} stopped answering" in cause, doc.get("change")
        assert took <= DEFAULT_LOST_AFTER + 1.0  # the bound, plus a loaded machine's polling
        time.sleep(max(0.0, 8.0 - (time.monotonic() - stopped)))
    finally:
        victim.proc.send_signal(signal.SIGCONT)
        woke = time.monotonic()
    for t in asks:
        t.join(60)
    others = ", ".join(m.name for m in fleet.members if m is not victim)
    for out in (streamed, whole):
        assert "at" in out and out["at"] - woke < 10, (out, "the forwarded request hung")
        error = out["error"]
        assert isinstance(error, dict) and error["code"] == "member_lost", out
        assert f"this member ({victim.name}) did not run for" in error["message"], out
        assert "the session goes on without this member" in error["message"], out
    assert streamed["status"] == 200 and whole["status"] == 503, (streamed, whole)  # the stream had begun
    named = whole["error"]["message"]
    assert all(m.name in named for m in fleet.members if m is not victim), (others, named)
    assert victim.proc.wait(30) == 0, victim.log_text()[-2000:]  # it ends, and not as a failure
    said = "\n".join(x for x in victim.log_text().splitlines() if x.startswith("kafila:"))
    assert f"this member ({victim.name}) did not run for" in said and "counted it lost" in said, said
    assert "The session goes on without this member" in said and "503 from now on" not in said, said
