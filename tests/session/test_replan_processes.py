"""A session that survives losing a member: four member processes (`kafila host`, `kafila join`) on
loopback; a member that is not the head is killed with SIGKILL while four greedy answers stream;
the host re-plans over the three survivors and every answer completes, identical to its answer
without the kill. Survivors that cannot hold the model end the session cleanly, naming the device."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from kafila.demo.fleet import FleetMember, LocalFleet

pytestmark = [pytest.mark.network, pytest.mark.slow]
MODEL = "smollm2-135m"
PROMPTS = (
    "Tell me a long story about a lighthouse keeper.",
    "Explain how bread rises, step by step.",
    "Write a poem about the sea in winter.",
    "List ten facts about owls.",
)
MAX_TOKENS = 60


def _stream(url: str, prompt: str, out: dict[str, object], started: threading.Event | None = None) -> None:
    """One streaming greedy chat answer from `url`: its text, or the error it ended with."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}  # fmt: skip
    text, chunks = [], 0
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.read().decode()}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]
                    return
                text.append(chunk["choices"][0]["delta"].get("content") or "")
                chunks += 1
                if started is not None and chunks == 12:
                    started.set()
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["text"] = "".join(text)


def _answers(url: str | list[str], kill: threading.Event | None = None) -> list[dict[str, object]]:
    """The four answers, each streamed from `url` (or from its own URL, in order)."""
    urls = [url] * len(PROMPTS) if isinstance(url, str) else url
    outs: list[dict[str, object]] = [{} for _ in PROMPTS]
    threads = [
        threading.Thread(target=_stream, args=(u, p, o, kill if i == 0 else None))
        for i, (u, p, o) in enumerate(zip(urls, PROMPTS, outs, strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    return outs


def _head_and_victim(fleet: LocalFleet) -> tuple[dict, FleetMember, FleetMember]:
    """The session serving epoch 1 over four members, its head, and a member that is neither the
    head nor the host (the one to lose)."""
    doc = fleet.session()
    assert doc["state"] == "serving" and doc["epoch"] == 1 and len(doc["ring"]) == 4
    head = next(m for m in fleet.members if m.name == doc["head"])
    victim = next(m for m in fleet.members if m.name not in (doc["head"], fleet.members[0].name))
    assert head.api_url is not None and victim.proc is not None
    return doc, head, victim


ONE_THREAD = ("--dead-after", "3", "--threads", "1")  # one thread each: four members on two cores


@pytest.fixture
def fleet4(smollm2_path, tmp_path):
    args = ONE_THREAD
    with LocalFleet((None,) * 4, MODEL, context=512, concurrency=4, workdir=tmp_path, stagger=False,
                    extra_args=args) as f:  # fmt: skip
        yield f


def _answers_through_a_kill(urls: str | list[str], kill: Callable[[], None]) -> list[dict[str, object]]:
    """`_answers(urls)`, with `kill` run on another thread once the answers have started streaming."""
    started = threading.Event()
    killer = threading.Thread(target=lambda: started.wait(120) and kill())
    killer.start()
    got = _answers(urls, started)
    killer.join()
    return got


def _sigkill(member: FleetMember) -> None:
    assert member.proc is not None
    member.proc.send_signal(signal.SIGKILL)  # mid-answer, no goodbye


def test_a_killed_member_is_planned_around_and_every_streaming_answer_completes_unchanged(
    fleet4: LocalFleet,
) -> None:
    doc, head, victim = _head_and_victim(fleet4)
    expected = _answers(head.api_url)
    assert all("text" in o and "error" not in o for o in expected), expected
    got = _answers_through_a_kill(head.api_url, lambda: _sigkill(victim))
    assert victim.proc.poll() is not None, "the answers ended before the member could be killed"
    assert [o.get("error") for o in got] == [None] * 4, got
    assert [o["text"] for o in got] == [o["text"] for o in expected]
    after = fleet4.session()
    assert after["state"] == "serving" and after["epoch"] == 2, after
    assert victim.name not in after["ring"] and len(after["ring"]) == 3
    assert victim.name in after["change"]["cause"]
    for m in fleet4.members:
        if m is not victim:
            assert f"epoch 2 serving: ring {' -> '.join(after['ring'])}" in m.log_text(), m.name
    host = fleet4.members[0].name
    replans = [r for r in fleet4.traces(host) if r.get("type") == "replan"]
    deadline = time.monotonic() + 10
    while not replans and time.monotonic() < deadline:  # written once the first token came
        time.sleep(0.2)
        replans = [r for r in fleet4.traces(host) if r.get("type") == "replan"]
    assert replans and replans[0]["epoch"] == 2 and victim.name in replans[0]["cause"], replans
    assert set(replans[0]["new_blocks"]) == set(after["ring"])
    if host == doc["head"]:  # the host sees the tokens only as the head
        assert replans[0]["carried"] == 4 and replans[0]["first_token_s"] is not None
    records = [r for r in fleet4.traces(after["head"]) if r.get("type") == "request"]
    assert {r["epoch"] for r in records} == {1, 2}, records  # answered before the loss, and across it


def _kill_the_head(fleet: LocalFleet, through: list[FleetMember]) -> tuple[FleetMember, dict]:
    """Four greedy answers streamed through `through` (members that are not the head), the head
    killed (SIGKILL) mid-answer: every answer completes identical to its answer without the kill.
    Returns the member killed and the host's /session after, at epoch 2 with the head moved."""
    doc = fleet.session()
    assert doc["state"] == "serving" and doc["epoch"] == 1 and len(doc["ring"]) == 4, doc
    head = next(m for m in fleet.members if m.name == doc["head"])
    assert head.proc is not None and head not in through and all(m.api_url for m in through)
    urls = [str(through[i % len(through)].api_url) for i in range(len(PROMPTS))]
    expected = _answers(urls)
    assert all("text" in o and "error" not in o for o in expected), expected
    got = _answers_through_a_kill(urls, lambda: _sigkill(head))
    assert head.proc.poll() is not None, "the answers ended before the head could be killed"
    assert [o.get("error") for o in got] == [None] * 4, got
    assert [o["text"] for o in got] == [o["text"] for o in expected]
    after = fleet.session()
    assert after["state"] == "serving" and after["epoch"] == 2, after
    assert head.name not in after["ring"] and after["head"] != head.name, after
    assert head.name in after["change"]["cause"]
    moved = next(m for m in fleet.members if m.name == after["head"])
    assert "this member is the head from epoch 2 on" in moved.log_text()
    for m in fleet.members:
        if m is not head:
            assert f"epoch 2 serving: ring {' -> '.join(after['ring'])}" in m.log_text(), m.name
    again = _answers(urls)  # the new ring serves new requests the same way
    assert [o.get("text") for o in again] == [o["text"] for o in expected], again
    return head, after


def test_a_killed_head_moves_to_a_survivor_and_every_answer_streamed_through_the_others_completes_unchanged(
    smollm2_path, tmp_path
) -> None:
    """The host offers 0.1 GB (--memory-gb, the planner's input), less than the head's tensors
    (0.11 GB in fp32), so the planner puts the head on a joining member, at forming and again after
    the loss. Four greedy answers stream through members that survive (two through the host, two
    through another member, which may become the head); the head is killed mid-answer. The host
    re-plans with the head on a joining survivor, the members send their requests to it with the
    tokens streamed so far, and every answer completes unchanged: no token repeated, none missing."""
    limits = [("--memory-gb", "0.1"), (), (), ()]
    with LocalFleet((None,) * 4, MODEL, context=512, concurrency=4, workdir=tmp_path, stagger=False,
                    extra_args=ONE_THREAD, member_args=limits) as fleet:  # fmt: skip
        host = fleet.members[0]
        other = next(m for m in fleet.members[1:] if m.name != fleet.head)
        _, after = _kill_the_head(fleet, [host, other])
        assert after["head"] != host.name, after


def test_a_killed_head_moves_to_the_host_whose_own_clients_answers_go_on_there(
    smollm2_path, tmp_path
) -> None:
    """The host runs at a fifth of a CPU (--emulate-speed 0.2), so the planner puts the head on the
    one joining member that can hold it; the two others offer 0.1 GB, less than the head's tensors,
    so once that member is killed (SIGKILL) mid-answer only the host can be the head. The host
    becomes it: the answers its own clients stream (forwarded until then) become the new head's
    own, the other member sends its requests over, and all four complete unchanged."""
    limits = [(), ("--memory-gb", "0.1"), ("--memory-gb", "0.1"), ()]
    with LocalFleet((0.2, None, None, None), MODEL, context=512, concurrency=4, workdir=tmp_path,
                    stagger=False, extra_args=ONE_THREAD, member_args=limits) as fleet:  # fmt: skip
        host, beta = fleet.members[0], fleet.members[1]
        assert fleet.head == fleet.members[3].name, fleet.session()  # the one that can hold it
        _, after = _kill_the_head(fleet, [host, beta])
        assert after["head"] == host.name, after
        assert "this member is the head from epoch 2 on: 2 request(s) carried here" in host.log_text()


def test_survivors_that_cannot_hold_the_model_end_the_session_naming_the_device(
    smollm2_path, tmp_path
) -> None:
    """Every member offers 0.16 GB (--memory-gb, the planner's input): four hold the fp32 model
    (about 0.54 GB), three cannot. A member killed: the host's re-plan is refused, and every
    survivor says the planner's reason and exits, none left answering 503."""
    small = [("--memory-gb", "0.16")] * 4
    with LocalFleet((None,) * 4, MODEL, context=512, workdir=tmp_path, stagger=False,
                    extra_args=ONE_THREAD, member_args=small) as fleet:  # fmt: skip
        host = fleet.members[0]
        victim = next(m for m in fleet.members[1:] if m.name != fleet.head)
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        survivors = [m for m in fleet.members if m is not victim]
        for m in survivors:
            assert m.proc is not None
            assert m.proc.wait(60) == 0, m.log_text()[-2000:]
        ended = f"{victim.name} was lost"
        assert "the members left cannot hold the model" in host.log_text()
        for m in survivors:
            said = [x for x in m.log_text().splitlines() if x.startswith("kafila:") and ended in x]
            line = next((x for x in said if "ended" in x or "ends" in x), "")
            assert "cannot hold the model" in line and "MB more memory" in line, (m.name, said)


def _epoch(url: str) -> int:
    try:
        return int(httpx.get(f"{url}/session", timeout=5).json()["epoch"])
    except (httpx.HTTPError, KeyError, ValueError):
        return 0


def test_a_frozen_member_is_planned_around_and_told_so_when_it_wakes(fleet4: LocalFleet) -> None:
    """A member that is not the head is stopped (SIGSTOP) mid-answer for longer than the bound: the
    host re-plans around it and every streaming answer completes unchanged. Resumed (SIGCONT) after
    the re-plan, it finds that it was counted lost, says so, and ends; the others keep serving."""
    _, head, victim = _head_and_victim(fleet4)
    expected = _answers(head.api_url)
    assert all("text" in o and "error" not in o for o in expected), expected
    started, woken = threading.Event(), threading.Event()

    def freeze() -> None:
        if not started.wait(120):
            return
        assert victim.proc is not None and head.api_url is not None
        victim.proc.send_signal(signal.SIGSTOP)  # frozen mid-answer: no goodbye, no links closed
        deadline = time.monotonic() + 60
        while _epoch(head.api_url) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        victim.proc.send_signal(signal.SIGCONT)  # wakes in the old epoch while the new one streams
        woken.set()

    freezer = threading.Thread(target=freeze)
    freezer.start()
    got = _answers(head.api_url, started)
    freezer.join()
    assert woken.is_set(), "the answers ended before the member could be frozen"
    assert [o.get("error") for o in got] == [None] * 4, got
    assert [o["text"] for o in got] == [o["text"] for o in expected]
    after = fleet4.session()
    assert after["state"] == "serving" and after["epoch"] == 2, after
    assert victim.name not in after["ring"] and victim.name in after["change"]["cause"]
    assert victim.proc.wait(30) == 0, victim.log_text()[-2000:]  # it ends, and not as a failure
    said = "\n".join(x for x in victim.log_text().splitlines() if x.startswith("kafila:"))
    assert f"this member ({victim.name}) did not run for" in said and "counted it lost" in said, said
    assert "The session goes on without this member" in said and "503 from now on" not in said, said
    for m in fleet4.members:  # nobody else was blamed, and the ring still answers
        if m is not victim:
            assert m.proc is not None and m.proc.poll() is None, m.log_text()[-2000:]
    again = _answers(head.api_url)
    assert [o.get("error") for o in again] == [None] * 4 and [o["text"] for o in again] == [
        o["text"] for o in expected
    ]


def _kill_two(host: FleetMember, first: FleetMember, second: FleetMember) -> None:
    """Stop `second` (SIGSTOP: it can no longer say it is ready for any epoch), SIGKILL `first`,
    then SIGKILL `second` the moment `host`'s console says its re-plan for epoch 2 started: the
    second loss lands during the move however fast the survivors load their new blocks (a move can
    be over in 0.1 s, before a kill made only at that moment is noticed)."""
    assert first.proc is not None and second.proc is not None
    second.proc.send_signal(signal.SIGSTOP)
    first.proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 60
    while "re-planning for epoch 2" not in host.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    second.proc.send_signal(signal.SIGKILL)


def test_a_second_member_killed_when_the_host_says_its_replan_started_is_planned_around_too(
    fleet4: LocalFleet,
) -> None:
    """Timing set by the test: a member is killed (SIGKILL) mid-answer, and a second one, stopped
    since, the moment the host's console says its re-plan for epoch 2 started, so the second loss
    lands while the survivors move to epoch 2 (the stopped member can never say it is ready). The
    host abandons that move and re-plans over the two members left for epoch 3; every streaming
    answer completes, identical to its answer without the kills."""
    doc, head, _ = _head_and_victim(fleet4)
    host = fleet4.members[0]
    first, second = [m for m in fleet4.members if m.name not in (doc["head"], host.name)][:2]
    assert first.proc is not None and second.proc is not None
    expected = _answers(head.api_url)
    assert all("text" in o and "error" not in o for o in expected), expected
    got = _answers_through_a_kill(head.api_url, lambda: _kill_two(host, first, second))
    assert first.proc.poll() is not None and second.proc.poll() is not None
    assert [o.get("error") for o in got] == [None] * 4, got
    assert [o["text"] for o in got] == [o["text"] for o in expected]
    after = fleet4.session()
    assert after["state"] == "serving" and after["epoch"] == 3, after
    left = [m for m in fleet4.members if m not in (first, second)]
    assert sorted(after["ring"]) == sorted(m.name for m in left) and after["head"] == doc["head"]
    assert first.name in after["change"]["cause"] and second.name in after["change"]["cause"], after
    said = host.log_text()
    assert f"{second.name} was lost during the move to epoch 2: that move is abandoned" in said
    for m in left:
        assert f"epoch 3 serving: ring {' -> '.join(after['ring'])}" in m.log_text(), m.name
        assert "epoch 2 serving" not in m.log_text(), m.name


def test_a_second_member_killed_when_the_host_says_its_replan_started_ends_a_session_two_cannot_hold(
    smollm2_path, tmp_path
) -> None:
    """Timing set by the test, as above; every member offers 0.24 GB (--memory-gb, the planner's
    input): three hold the fp32 model (about 0.54 GB), two cannot. The host abandons the move to
    epoch 2 and ends the session with the planner's refusal, naming the devices and their numbers;
    every survivor says it and exits 0, none left answering 503 or waiting for epoch 2."""
    small = [("--memory-gb", "0.24")] * 4
    with LocalFleet((None,) * 4, MODEL, context=512, workdir=tmp_path, stagger=False,
                    extra_args=ONE_THREAD, member_args=small) as fleet:  # fmt: skip
        host = fleet.members[0]
        first, second = [m for m in fleet.members[1:] if m.name != fleet.head][:2]
        _kill_two(host, first, second)
        survivors = [m for m in fleet.members if m not in (first, second)]
        for m in survivors:
            assert m.proc is not None
            assert m.proc.wait(60) == 0, m.log_text()[-2000:]
        ended = f"{first.name} was lost"
        assert "epoch 2 serving" not in host.log_text()
        for m in survivors:
            said = [x for x in m.log_text().splitlines() if x.startswith("kafila:") and ended in x]
            line = next((x for x in said if "ended" in x or "ends" in x), "")
            assert f"then {second.name} was lost" in line, (m.name, said)
            assert "cannot hold the model" in line and "MB more memory" in line, (m.name, said)
