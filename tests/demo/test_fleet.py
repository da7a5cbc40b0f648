"""The local fleet: a real `kafila rendezvous`, `kafila host` and `kafila join` processes on this
machine, members slowed by an emulated pace on one pinned CPU each or inside cgroup v1 cpu groups;
startup failures and shutdown leave nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from kafila.demo import fleet as localfleet
from kafila.demo.fleet import CGROUP_CPU, PERIOD_US, FleetError, LocalFleet

needs_cgroups = pytest.mark.skipif(
    localfleet.cgroup_unavailable() is not None,
    reason=f"CPU shares need root and cgroup v1 cpu: {localfleet.cgroup_unavailable()}",
)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.network
@needs_cgroups
def test_two_member_fleet_with_cpu_shares_serves_and_cleans_up(smollm2_path: Path, tmp_path: Path) -> None:
    fleet = LocalFleet([1.0, 0.5], context=256, workdir=tmp_path, wait_s=240, slow_by="quota")
    with fleet:
        assert fleet.shares_applied and "1.50 of" in fleet.shares_note
        for m, share in zip(fleet.members, (1.0, 0.5), strict=True):
            assert m.cgroup is not None and m.proc is not None
            quota, period = (int((m.cgroup / f"cpu.cfs_{k}_us").read_text()) for k in ("quota", "period"))
            assert (period, quota) == (PERIOD_US, round(share * PERIOD_US))
            assert str(m.proc.pid) in (m.cgroup / "cgroup.procs").read_text().split()
            doc = fleet.session(m.name)
            assert doc["state"] == "serving" and sorted(doc["ring"]) == ["alpha", "beta"]
            assert doc["ring"][0] == doc["head"]  # the planner places the head: either member
        assert set(fleet.plan["blocks"]) == {"alpha", "beta"}
        assert "uniform" in fleet.predicted_table() and "memory" in fleet.predicted_table()
        body = {
            "model": "smollm2-135m",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        r = httpx.post(f"{fleet.url(fleet.not_head())}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
        groups = [m.cgroup for m in fleet.members]
    assert all(m.proc is not None and m.proc.poll() is not None for m in fleet.members)
    assert fleet._rendezvous is not None and fleet._rendezvous.poll() is not None
    assert not any(g is not None and g.exists() for g in groups)
    assert not list(CGROUP_CPU.glob(f"{localfleet.GROUP_PREFIX}{os.getpid()}-*"))


@pytest.mark.slow
@pytest.mark.network
def test_paced_fleet_pins_each_member_to_one_cpu_and_emulates_its_share(
    smollm2_path: Path, tmp_path: Path
) -> None:
    fleet = LocalFleet([1.0, 0.25], context=256, workdir=tmp_path, wait_s=240)
    with fleet:
        assert fleet.shares_applied and "emulated" in fleet.shares_note
        for m in fleet.members:
            assert m.proc is not None and m.cgroup is None
            assert os.sched_getaffinity(m.proc.pid) == {fleet.cpus[m.name]}
        assert "emulating a slower device, 0.25 of this machine's speed" in fleet.members[1].log_text()
        body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4}
        body["temperature"] = 0  # greedy: the answer is fixed
        r = httpx.post(f"{fleet.url(fleet.not_head())}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]
        blocks = fleet.plan["blocks"]  # blocks per member
        assert blocks["beta"] < blocks["alpha"]  # the probe saw the quarter-speed member as slower
        for url in fleet.api_urls.values():  # every member exports the plan's bottleneck, not 0
            text = httpx.get(f"{url}/metrics", timeout=10).text
            [line] = [x for x in text.splitlines() if x.startswith("kafila_predicted_bottleneck_seconds{")]
            assert float(line.split()[-1]) * 1000 == pytest.approx(fleet.plan["bottleneck_ms"], abs=0.01)
    assert all(m.proc is not None and m.proc.poll() is not None for m in fleet.members)


def test_pace_puts_the_largest_shares_on_the_least_loaded_cpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(localfleet.os, "sched_getaffinity", lambda pid: {0, 1})  # simulated 2-CPU machine
    fleet = LocalFleet([0.25, 1.0, 0.5, None], workdir=tmp_path)
    fleet._check_shares()
    assert fleet.cpus == {"beta": 0, "gamma": 1, "alpha": 1}  # delta (no share) is not pinned
    monkeypatch.setattr(localfleet.shutil, "which", lambda cmd: None)  # simulated machine without taskset
    unpinned = LocalFleet([1.0, 0.5], workdir=tmp_path)
    unpinned._check_shares()
    assert unpinned.cpus == {"alpha": None, "beta": None} and "one thread (no taskset" in unpinned.shares_note
    with pytest.raises(ValueError, match=r"at most 1 \(got \[1.5\]\)"):
        LocalFleet([1.5, 0.5], workdir=tmp_path)._check_shares()


@pytest.mark.network
def test_a_member_that_cannot_start_is_named_and_everything_stops(tmp_path: Path) -> None:
    fleet = LocalFleet([None, None], model="no-such-model", workdir=tmp_path, wait_s=60)
    with pytest.raises(FleetError, match=r"(?s)member alpha \(host\) exited with [1-9].*no-such-model"):
        fleet.start()
    assert fleet.members[0].proc is not None and fleet.members[0].proc.poll() is not None
    assert len(fleet.members) == 1  # the joiner never started: there was no code
    assert fleet._rendezvous is not None and fleet._rendezvous.poll() is not None


def test_quota_keeps_the_kernel_minimum_by_lengthening_the_period() -> None:
    assert localfleet.quota_for(0.25, 4000) == (4000, 1000)
    assert localfleet.quota_for(1.5, 4000) == (4000, 6000)
    assert localfleet.quota_for(0.1, 4000) == (10000, 1000)


def test_shares_required_without_root_refuse_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(localfleet.os, "geteuid", lambda: 1000)  # simulated non-root user
    fleet = LocalFleet([1.0, 0.25], workdir=tmp_path, require_shares=True, slow_by="quota")
    with pytest.raises(FleetError, match="CPU shares NOT applied \\(not root"):
        fleet.start()
    assert fleet.members == [] and fleet._rendezvous is None


def test_closing_ignores_a_second_ctrl_c_or_kill_until_everything_is_stopped() -> None:
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with localfleet._interrupts_ignored():
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt with the default handler
        os.kill(os.getpid(), signal.SIGTERM)  # would end the process with the default action
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    assert {sig: signal.getsignal(sig) for sig in before} == before


OWNER = """
import json, sys, time
from kafila.demo.fleet import LocalFleet
with LocalFleet([None], context=128, workdir=sys.argv[1], wait_s=240) as fleet:
    pids = [m.proc.pid for m in fleet.members] + [fleet._rendezvous.pid]
    print("PIDS", json.dumps(pids), flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
@pytest.mark.network
def test_a_terminated_owner_stops_its_fleet(smollm2_path: Path, tmp_path: Path) -> None:
    """`kill` (SIGTERM) of the process that owns a fleet stops the members and the rendezvous,
    which run in their own process sessions, instead of leaving them running. The owner runs as a
    shell's background job does, SIGINT ignored (and so its members): they still close their
    session themselves (killed after the grace period, their logs would not say so)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    argv = [sys.executable, "-c", OWNER, str(tmp_path)]

    def as_a_background_job() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, preexec_fn=as_a_background_job) as owner:
        try:
            assert owner.stdout is not None
            line = ""
            while not line.startswith("PIDS "):  # the fleet's own log lines come first
                line = owner.stdout.readline()
                assert line, "the fleet's owner exited before its fleet was up"
            pids = json.loads(line[5:])
            assert all(_alive(p) for p in pids)
            owner.send_signal(signal.SIGTERM)
            assert owner.wait(30) == 128 + signal.SIGTERM
        finally:
            owner.kill()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)]
    assert "terminated: session closed" in (tmp_path / "alpha.log").read_text()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
