"""Members that arrive at a serving session, as processes on loopback (`kafila host`, `kafila join`):
a member killed mid-session is planned around, then comes back with `kafila join CODE` under its
name; a new member joins the serving session. Each time the host lets the planner decide
(kafila.planner.replan.on_arrived): plan it in with a new epoch, or keep it waiting as a spare; the
test reads that decision and the predicted gain from the host's console line and checks that the
session did what the line says (the gain against the 5% head margin), then that greedy answers
are the same as before any change."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from kafila.demo.fleet import FleetMember, LocalFleet

pytestmark = [pytest.mark.network, pytest.mark.slow]
MODEL = "smollm2-135m"
PROMPTS = ("Explain how bread rises, step by step.", "List ten facts about owls.")
MARGIN = 5.0  # the head margin, in percent (kafila.planner.head.MU)
_JOINED = r"{name} joined: time per token (\d+\.\d)% better"
_SPARE = r"{name} waits as a spare: (.*)"


def _greedy(url: str) -> list[str]:
    out = []
    for prompt in PROMPTS:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 32, "temperature": 0}  # fmt: skip
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


def _until(check, what: str, within: float = 120.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.25)
    raise AssertionError(f"no {what} within {within:g} s")


def _decision(host: FleetMember, name: str, after: int) -> tuple[str, str]:
    """The host's decision about `name` in its console after offset `after`: ("joined", gain %) or
    ("spare", why)."""

    def seen() -> tuple[str, str] | None:
        text = host.log_text()[after:]
        joined = re.search(_JOINED.format(name=re.escape(name)), text)
        if joined:
            return "joined", joined.group(1)
        spare = re.search(_SPARE.format(name=re.escape(name)), text)
        return ("spare", spare.group(1)) if spare else None

    return _until(seen, f"decision about {name} on the host's console")


def _check_decision(fleet: LocalFleet, member: FleetMember, decision: tuple[str, str], epoch: int) -> int:
    """The session did what the host said; returns the epoch serving now."""
    kind, said = decision
    host = fleet.session()
    if kind == "joined":
        assert float(said) > MARGIN, said
        doc = _until(
            lambda: (d := fleet.session())["epoch"] == epoch + 1 and d["state"] == "serving" and d,
            f"epoch {epoch + 1} serving",
        )
        assert member.name in doc["ring"] and member.name not in doc.get("spares", []), doc
        _until(lambda: f"epoch {epoch + 1} serving" in member.log_text(), f"{member.name} serving")
        return epoch + 1
    gain = re.search(r"(\d+\.\d)% better, not more than the 5\.0% margin", said)
    assert gain is None or float(gain.group(1)) <= MARGIN, said
    assert host["epoch"] == epoch and member.name not in host["ring"], host
    assert member.name in host["spares"], host
    _until(lambda: "the host keeps this member as a spare" in member.log_text(), "the spare's line")
    assert member.proc is not None and member.proc.poll() is None
    return epoch


def test_a_lost_member_comes_back_and_a_new_member_joins_the_serving_session(smollm2_path, tmp_path) -> None:
    """Four members (as the loss tests: with three, losing one can move the head, which ends the
    session), the fp32 default model, no memory limit. On loopback every member measures about the
    same bandwidth and the planner prices each member's blocks on its own, so four members predict
    a time per token better than three; by how much depends on the probes (runs here saw 4.1%:
    the returning member waited as a spare, and was planned in with the next arrival). The new
    member offers 0.03 GB (--memory-gb), room for about 4 of the 30 blocks, so it adds little and
    most likely waits as a spare: then a ring member is killed and the re-plan over everyone
    present takes the spares in. The test hard-codes no decision: it checks that the session did
    what the host's line, with the planner's gain against the 5% margin, says."""
    args = ("--dead-after", "3", "--threads", "1")  # one thread each: 4 members on 2 cores
    with LocalFleet((None,) * 4, MODEL, context=512, concurrency=2, workdir=tmp_path, stagger=False,
                    extra_args=args) as fleet:  # fmt: skip
        host = fleet.members[0]
        head_url = fleet.url(fleet.head)
        before = _greedy(head_url)
        victim = next(m for m in fleet.members[1:] if m.name != fleet.head)
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        _until(lambda: (d := fleet.session())["epoch"] == 2 and d["state"] == "serving", "epoch 2 serving")
        assert victim.name not in fleet.session()["ring"]
        assert _greedy(head_url) == before

        mark = len(host.log_text())
        back = fleet.add_member(victim.name)  # the lost member comes back, as its person would
        epoch = _check_decision(fleet, back, _decision(host, victim.name, mark), 2)
        assert f"{victim.name} is back" in host.log_text()[mark:]
        assert _greedy(head_url) == before

        mark = len(host.log_text())
        new = fleet.add_member("epsilon", ("--memory-gb", "0.03"))  # room for about 4 of 30 blocks
        epoch = _check_decision(fleet, new, _decision(host, "epsilon", mark), epoch)
        assert "epsilon arrived" in host.log_text()[mark:]
        assert _greedy(head_url) == before
        doc = fleet.session()
        if doc["spares"]:  # a spare is planned in when someone is lost
            gone = next(m for m in fleet.members[1:] if m.name in doc["ring"] and m.name != doc["head"])
            assert gone.proc is not None
            gone.proc.send_signal(signal.SIGKILL)
            after = _until(
                lambda: (d := fleet.session())["epoch"] == epoch + 1 and d["state"] == "serving" and d,
                f"epoch {epoch + 1} serving",
            )
            assert set(doc["spares"]) <= set(after["ring"]) and not after["spares"], after
            assert gone.name not in after["ring"]
            for m in fleet.members:
                if m.name in doc["spares"]:
                    _until(lambda m=m: "session ready" in m.log_text(), f"spare {m.name} serving")
            assert _greedy(head_url) == before
