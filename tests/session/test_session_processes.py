"""Members as separate processes (`kafila rendezvous`, `kafila host`, `kafila join`) on loopback:
a member killed in the middle of a generation makes the request fail fast, and the others notice."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from kafila.demo.fleet import LocalFleet

pytestmark = [pytest.mark.network, pytest.mark.slow]
MODEL = "smollm2-135m"


@pytest.fixture
def fleet(smollm2_path, tmp_path):
    with LocalFleet((None, None, None), MODEL, context=512, workdir=tmp_path, stagger=False) as f:
        yield f


def test_killed_member_fails_the_request_within_10_s_and_the_others_notice(fleet: LocalFleet) -> None:
    doc = fleet.session()
    assert doc["state"] == "serving" and len(doc["ring"]) == 3
    ready = f"kafila: session ready: 3 members, head {doc['head']}"  # every member says it, not only the host
    deadline = time.monotonic() + 10
    while not all(ready in m.log_text() for m in fleet.members) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [m.name for m in fleet.members if ready not in m.log_text()] == []
    others = [m for m in fleet.members if m.name != doc["head"]]
    asker, victim = others[0], others[1]
    assert victim.proc is not None
    assert httpx.get(f"{asker.api_url}/healthz", timeout=5).json() == {"ok": True, "state": "serving"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True}  # fmt: skip
    lines, killed_at, error = 0, None, None
    with httpx.stream("POST", f"{asker.api_url}/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                break
            lines += 1
            if lines == 3:
                victim.proc.send_signal(signal.SIGKILL)  # mid-generation, no goodbye
                killed_at = time.monotonic()
    assert killed_at is not None, "the answer ended before the member could be killed"
    failed_after = time.monotonic() - killed_at
    assert error is not None and victim.name in error["message"], error
    assert failed_after < 10, f"the request failed {failed_after:.1f} s after the kill"
    deadline = time.monotonic() + 10  # every other member notices within the heartbeat window
    for m in fleet.members:
        while m is not victim:
            state = httpx.get(f"{m.api_url}/session", timeout=5).json()
            if state["state"] == "broken" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if m is not victim:
            assert state["state"] == "broken" and victim.name in state["error"], (m.name, state)
            told = "kafila: the ring is broken: " in m.log_text() and "form a new session" in m.log_text()
            assert told, f"{m.name} did not tell the person at its terminal"
            health = httpx.get(f"{m.api_url}/healthz", timeout=5)  # a monitor sees the member down
            assert health.status_code == 503 and health.json()["ok"] is False, health.text
            assert victim.name in health.json()["error"]


def test_a_member_sent_sigterm_closes_its_links_and_the_others_notice_at_once(fleet: LocalFleet) -> None:
    """`kill` or `docker stop` (SIGTERM) ends a member as Ctrl-C does: links closed with a reason,
    exit status 143, and the members that stay see the ring broken without waiting for beats, and
    why (it said "session ended", which read as if the whole session had)."""
    doc = fleet.session()
    # neither the head nor the host (members[0]), whose ending ends every member's part
    victim = next(m for m in fleet.members[1:] if m.name != doc["head"])
    assert victim.proc is not None
    sent = time.monotonic()
    victim.proc.send_signal(signal.SIGTERM)
    assert victim.proc.wait(15) == 128 + signal.SIGTERM
    log = (fleet.workdir / f"{victim.name}.log").read_text()
    assert "terminated: session closed" in log and "link_closed" in log
    for m in fleet.members:
        while m is not victim:
            state = httpx.get(f"{m.api_url}/session", timeout=5).json()
            if state["state"] == "broken" or time.monotonic() - sent > 20:
                break
            time.sleep(0.1)
        if m is not victim:
            assert state["state"] == "broken", (m.name, state)
            assert f"{victim.name} was stopped and left the session" in state["error"], (m.name, state)
    noticed = time.monotonic() - sent
    assert noticed < 5, f"the others noticed {noticed:.1f} s after the member was terminated"


def test_the_host_ending_the_session_ends_every_member(fleet: LocalFleet) -> None:
    """The host stopped on purpose (SIGTERM, as Ctrl-C) closes its links as `ended`: every member
    says so and exits 0 at once, rather than staying up answering 503 for a ring that broke."""
    host = fleet.members[0]
    assert host.proc is not None and fleet.session()["state"] == "serving"
    host.proc.send_signal(signal.SIGTERM)
    assert host.proc.wait(15) == 128 + signal.SIGTERM
    for m in fleet.members[1:]:
        assert m.proc is not None
        assert m.proc.wait(10) == 0, m.log_text()[-2000:]
        log = m.log_text()
        assert f"kafila: the host {host.name} ended the session; this member stops" in log
        assert "form a new session" not in log  # not told it answers 503 from now on
