"""The rendezvous killed (SIGKILL) and restarted on the same port while a session of real member
processes (`kafila rendezvous`, `kafila host`, `kafila join`) streams requests: no request fails,
every member reconnects and registers the session again, and a new `kafila join CODE` afterwards
reaches the host through the restarted rendezvous."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from kafila.demo.fleet import LocalFleet

pytestmark = [pytest.mark.network, pytest.mark.slow]
MODEL = "smollm2-135m"


@pytest.fixture
def fleet(smollm2_path, tmp_path):
    with LocalFleet((None, None), MODEL, context=512, concurrency=2, workdir=tmp_path, stagger=False) as f:
        yield f


@dataclass
class Requests:
    """Streaming greedy requests sent back to back to one member until `stop` is set."""

    url: str
    stop: threading.Event = field(default_factory=threading.Event)
    done: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, finish reason)
    failed: list[str] = field(default_factory=list)
    first_chunk: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 48, "temperature": 0, "stream": True}  # fmt: skip
        while not self.stop.is_set():
            start, finish = time.monotonic(), None
            try:
                with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=60) as r:
                    if r.status_code != 200:
                        self.failed.append(f"HTTP {r.status_code}: {r.read()[:300]!r}")
                        continue
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.failed.append(str(chunk["error"]))
                            break
                        self.first_chunk.set()
                        finish = chunk["choices"][0].get("finish_reason") or finish
            except httpx.HTTPError as exc:
                self.failed.append(repr(exc))
                continue
            if finish is None:
                self.failed.append("the stream ended without a finish reason")
            else:
                self.done.append((start, time.monotonic(), finish))


def _states(fleet: LocalFleet) -> dict[str, dict]:
    return {m.name: httpx.get(f"{m.api_url}/session", timeout=5).json()["rendezvous"] for m in fleet.members}


def _until(check, what: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        time.sleep(0.1)


def test_a_killed_rendezvous_restarted_on_its_port_fails_no_request_and_takes_joins_again(
    fleet: LocalFleet,
) -> None:
    streams = [Requests(m.api_url) for m in fleet.members if m.api_url]  # one client at each member
    threads = [threading.Thread(target=s.run, daemon=True) for s in streams]
    for t in threads:
        t.start()
    try:
        for s in streams:
            assert s.first_chunk.wait(60), "no request streamed before the kill"
        killed = time.monotonic()
        fleet.stop_rendezvous()  # SIGKILL: no close frame, the members see the connection drop
        _until(lambda: all(v["state"] == "reconnecting" for v in _states(fleet).values()), "reconnecting", 10)
        time.sleep(1.0)  # down for a while: members keep retrying, requests keep streaming
        seen = _states(fleet)
        for name, state in seen.items():
            assert state["attempt"] >= 1 and "connection refused" in state["reason"], (name, state)
        fleet.restart_rendezvous()
        restarted = time.monotonic()
        _until(lambda: all(v["state"] == "connected" for v in _states(fleet).values()), "reconnected", 40)
        back = time.monotonic()
        for s in streams:  # one more request each, entirely after the restart
            count = len(s.done)
            _until(lambda s=s, count=count: len(s.done) > count or bool(s.failed), "a request after", 60)
    finally:
        for s in streams:
            s.stop.set()
        for t in threads:
            t.join(90)
    for s in streams:
        assert s.failed == [], s.failed
        # requests run back to back, so one was streaming at each moment: the one in flight at the
        # kill and the one in flight at the restart both completed (on a fast machine a request
        # is shorter than the outage, so no single one need span both)
        for moment, at in ((killed, "the kill"), (restarted, "the restart")):
            assert any(start < moment < end for start, end, _ in s.done), (
                f"no request at {s.url} in flight at {at} completed: {s.done} "
                f"(kill at {killed}, restart {restarted})"
            )
    print(
        f"rendezvous down {restarted - killed:.1f} s; "
        f"every member registered again {back - restarted:.1f} s after"
    )
    for m in fleet.members:  # one line per change of state, not one per attempt
        log = m.log_text()
        assert log.count("kafila: lost the rendezvous: ") == 1, log[-3000:]
        assert log.count("kafila: back at the rendezvous after ") == 1, log[-3000:]
    assert all(v.get("reconnects") == 1 for v in _states(fleet).values())
    # a new member's join reaches the host through the restarted rendezvous, which admits it into
    # the formed session: the host links with it, measures it and plans it in or keeps it as a
    # spare; "unknown session" would mean the restarted rendezvous lost it
    assert fleet.code is not None and fleet.rendezvous_url is not None
    argv = [sys.executable, "-P", "-m", "kafila", "join", fleet.code, "--rendezvous", fleet.rendezvous_url]
    argv += ["--name", "late", "--api", "off", "--wait", "60", "--threads", "1"]
    late = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        host_log = fleet.members[0].log_text
        _until(lambda: "late arrived:" in host_log(), "the host admitting the late member", 120)
    finally:
        late.terminate()
        said = late.communicate(timeout=30)[0]
    assert "unknown_session" not in said, said[-2000:]
    assert "late joined the serving session" in fleet.members[0].log_text()
