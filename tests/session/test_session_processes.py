"""Members as separate processes (`kafila rendezvous`, `kafila host`, `kafila join`) on loopback:
a member killed in the middle of a generation is planned around and the answer completes; a member
stopped on purpose, and the host ending the session."""

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
    with LocalFleet((None, None, None), MODEL, context=512, workdir=tmp_path, stagger=False,
                    extra_args=("--threads", "1")) as f:  # fmt: skip
        yield f


def test_a_killed_member_is_planned_around_and_a_forwarded_answer_completes_unchanged(
    fleet: LocalFleet,
) -> None:
    """A member killed mid-answer (SIGKILL: no goodbye): the survivors re-plan (kafila.session.
    forming.epochs) and an answer streaming from a member that is not the head, forwarded round
    the ring, completes identical to the same answer without the kill; the tokens that were on
    their way when the ring broke are made good (ring `resync`)."""
    doc = fleet.session()
    assert doc["state"] == "serving" and len(doc["ring"]) == 3
    ready = f"kafila: session ready: 3 members, head {doc['head']}"  # every member says it, not only the host
    deadline = time.monotonic() + 10
    while not all(ready in m.log_text() for m in fleet.members) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [m.name for m in fleet.members if ready not in m.log_text()] == []
    others = [m for m in fleet.members if m.name != doc["head"]]
    asker, victim = others[0], others[1]
    if victim is fleet.members[0]:  # the host's loss ends the session: kill the other one
        asker, victim = victim, asker
    assert victim.proc is not None
    assert httpx.get(f"{asker.api_url}/healthz", timeout=5).json() == {"ok": True, "state": "serving"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 80, "temperature": 0, "stream": True}  # fmt: skip

    def answer(kill_at: int | None) -> tuple[str, object]:
        parts, error = [], None
        with httpx.stream("POST", f"{asker.api_url}/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    break
                parts.append(chunk["choices"][0]["delta"].get("content") or "")
                if len(parts) == kill_at:
                    assert victim.proc is not None
                    victim.proc.send_signal(signal.SIGKILL)  # mid-generation, no goodbye
        return "".join(parts), error

    expected, error = answer(None)
    assert error is None, error
    got, error = answer(10)
    assert victim.proc.poll() is not None, "the answer ended before the member could be killed"
    assert error is None and got == expected, (error, got, expected)
    for m in fleet.members:
        if m is not victim:
            state = httpx.get(f"{m.api_url}/session", timeout=5).json()
            assert state["state"] == "serving" and state["epoch"] == 2, (m.name, state)
            assert victim.name not in state["ring"] and victim.name in state["change"]["cause"]
            health = httpx.get(f"{m.api_url}/healthz", timeout=5)
            assert health.json() == {"ok": True, "state": "serving"}, health.text


def test_a_member_sent_sigterm_closes_its_links_and_the_others_notice_at_once(fleet: LocalFleet) -> None:
    """`kill` or `docker stop` (SIGTERM) ends a member as Ctrl-C does: links closed with a reason,
    exit status 143, and the members that stay see it gone without waiting for beats, and why (it
    said "session ended", which read as if the whole session had), and re-plan around it."""
    doc = fleet.session()
    # neither the head nor the host (members[0]), whose ending ends every member's part
    victim = next(m for m in fleet.members[1:] if m.name != doc["head"])
    assert victim.proc is not None
    sent = time.monotonic()
    victim.proc.send_signal(signal.SIGTERM)
    noticed = {}
    for m in fleet.members:  # they re-plan around it (kafila.session.forming.epochs), saying why
        while m is not victim:  # (asked first: the victim's own exit may be slow on a loaded machine)
            state = httpx.get(f"{m.api_url}/session", timeout=5).json()
            if state["change"] is not None or time.monotonic() - sent > 20:
                noticed[m.name] = round(time.monotonic() - sent, 1)
                break
            time.sleep(0.1)
        if m is not victim:
            assert state["state"] in ("replanning", "serving"), (m.name, state)
            assert f"{victim.name} was stopped and left the session" in state["change"]["cause"], (
                m.name,
                state,
            )
    assert max(noticed.values()) < 5, f"the others noticed (s after the member was terminated): {noticed}"
    assert victim.proc.wait(15) == 128 + signal.SIGTERM
    log = (fleet.workdir / f"{victim.name}.log").read_text()
    assert "terminated: session closed" in log and "link_closed" in log


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
