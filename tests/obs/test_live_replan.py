"""Observability through a re-plan, on a real Prometheus scraping a real session: a rendezvous and
four members (kafila.demo.fleet) on loopback, each with its own metrics listener, steady greedy
traffic at the head at the default concurrency for the whole test.

Prometheus runs the repository's alert rules with every duration (`for:` and range windows) cut by
TIME_SCALE, scraping and evaluating every second, so a rule's minutes pass in seconds. A member that
is neither the host nor the head is killed (SIGKILL): within two scrapes of the survivors serving
the new epoch, every survivor's series describe the new ring exactly (members, blocks covering every
block once, edges, epoch); KafilaMemberDown and KafilaReplanned fire, and resolve once the member
has re-joined (and the re-plan window passed); Prometheus delivers them to a real Alertmanager
running the repository's prometheus/alertmanager.yml, which holds them while they fire. No other
alert fires at any time of the test, but one that tells the truth of this machine:
KafilaStageSlowerThanPredicted, where the stage's own requests averaged more than 1.25 times its
prediction over the alert's window (a shared CI machine under load computes slower than its members
probed when the session formed)."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.obs.test_dashboards import PROMETHEUS, RULES
from tests.obs.test_live_session import free_port, prometheus_config, query, wait_for

pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.timeout(900)]  # four members come and go
MODEL = "smollm2-135m"
BLOCKS = 30  # smollm2-135m's transformer blocks
TIME_SCALE = 8  # a rule's 1m lasts 7.5 s here
SCRAPE_S = 1.0
EXPECTED = {"KafilaMemberDown", "KafilaReplanned"}
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
ALERTMANAGER_CONFIG = RULES.parents[1] / "alertmanager.yml"  # prometheus/alertmanager.yml


@dataclass
class Monitored:
    fleet: Any
    metrics: dict[str, str]  # member -> its metrics listener
    prometheus: str  # base URL
    alertmanager: str  # base URL


def delivered(alertmanager: str) -> set[str]:
    """The alerts Alertmanager holds as active (received from Prometheus, not resolved)."""
    r = httpx.get(f"{alertmanager}/api/v2/alerts", params={"active": "true"}, timeout=10)
    r.raise_for_status()
    return {a["labels"]["alertname"] for a in r.json()}


@contextlib.contextmanager
def running(argv: list[str], log: Path, ready: str) -> Iterator[None]:
    """A server process logging to `log`, until its `ready` URL answers 200 (60 s at most)."""
    with log.open("wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                assert server.poll() is None, f"{argv[0]} exited: {log.read_text()[-2000:]}"
                try:
                    if httpx.get(ready, timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"{ready} did not answer within 60 s"
                time.sleep(0.3)
            yield
        finally:
            server.terminate()
            server.wait(timeout=30)


def scaled(duration: str) -> str:
    """A Prometheus duration ("15m", "30s", "1h") cut by TIME_SCALE, in milliseconds."""
    units = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
    parts = re.findall(r"(\d+)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    ms = sum(int(n) * units[u] for n, u in parts)
    return f"{max(1, ms // TIME_SCALE)}ms"


def scaled_rules(path: Path) -> Path:
    """The repository's alert rules with every `for:` and every range window cut by TIME_SCALE."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = scaled(str(rule["for"]))
            rule["expr"] = re.sub(r"\[(\w+)\]", lambda m: f"[{scaled(m.group(1))}]", str(rule["expr"]))
    path.write_text(yaml.safe_dump(rules))
    return path


@dataclass
class Traffic:
    """Greedy chat requests one after another at `url` until stopped: the default concurrency (1)."""

    url: str
    statuses: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        body = {"model": MODEL, "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": "Name three rivers."}]}  # fmt: skip
        while not self._stop.is_set():
            try:
                r = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=60)
                self.statuses.append(r.status_code)
                if r.status_code != 200:
                    time.sleep(0.5)  # re-planning: 503 with Retry-After, as a client would wait
            except httpx.HTTPError:
                self.statuses.append(0)
                time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()


@dataclass
class AlertWatch:
    """Every alert Prometheus reports firing, polled every half second in a thread."""

    base: str
    fired: dict[str, float] = field(default_factory=dict)  # alert -> first seen firing (monotonic)
    firing: set[str] = field(default_factory=set)  # firing at the last poll
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                alerts = httpx.get(f"{self.base}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
            except (httpx.HTTPError, KeyError, ValueError):
                time.sleep(0.5)
                continue
            now = {a["labels"]["alertname"] for a in alerts if a["state"] == "firing"}
            for name in now:
                self.fired.setdefault(name, time.monotonic())
            self.firing = now
            time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()


def slower_than_predicted(base: str) -> list[str]:
    """The stages KafilaStageSlowerThanPredicted fired for (from the compute histogram) whose own
    requests' measured/predicted ratios (the median step of each request, from its trace record)
    never averaged over 1.25 across the alert's window: those would be false alarms."""
    window = scaled("5m")
    fired = series(base, 'max_over_time(ALERTS{alertname="KafilaStageSlowerThanPredicted"}[1h])')
    false = []
    for a in fired:
        at = f'member="{a["member"]}", stage="{a["stage"]}", host="{a["host"]}"'
        ratio = query(
            base, f"max_over_time(avg_over_time(kafila_stage_prediction_ratio{{{at}}}[{window}])[1h:1s])"
        )
        if not ratio or max(float(r["value"][1]) for r in ratio) <= 1.25:
            false.append(f"{a['member']} stage {a['stage']}: {ratio}")
    return false


def series(base: str, expr: str) -> list[dict[str, str]]:
    return [r["metric"] for r in query(base, expr)]


def ring_edges(ring: list[str]) -> set[str]:
    return {f"{a}->{ring[(i + 1) % len(ring)]}" for i, a in enumerate(ring)}


def describes(base: str, host: str, ring: list[str], epoch: int) -> str:
    """Why member `host`'s series in Prometheus do not describe `ring` at `epoch` ("" when they do)."""
    at = f'host="{host}"'
    present = query(base, f"kafila_session_members_present{{{at}}}")
    if [float(p["value"][1]) for p in present] != [len(ring)]:
        return f"members present {present}"
    epochs = query(base, f"kafila_plan_epoch{{{at}}}")
    if [float(e["value"][1]) for e in epochs] != [epoch]:
        return f"plan epoch {epochs}"
    stages = series(base, f"kafila_stage_blocks{{{at}}}")
    got = sorted((int(s["stage"]), s["member"], int(s["first_block"]), int(s["last_block"]), s["epoch"])
                 for s in stages)  # fmt: skip
    if [(i, m, e) for i, m, _, _, e in got] != [(i, m, str(epoch)) for i, m in enumerate(ring)]:
        return f"stages {got}"
    covered = [b for _, _, a, z, _ in got for b in range(a, z)]
    if covered != list(range(BLOCKS)):
        return f"blocks {got} do not cover every block once"
    edges = series(base, f"kafila_edge_info{{{at}}}")
    if {e["edge"] for e in edges} != ring_edges(ring) or {e["epoch"] for e in edges} != {str(epoch)}:
        return f"edges {sorted((e['edge'], e['epoch']) for e in edges)}"
    gone = [
        s for s in series(base, f'{{{at}, __name__=~"kafila_(stage|hop|edge)_.*"}}')
        if (s.get("member") not in (None, *ring))
        or any(p not in ring for p in (s.get("hop") or s.get("edge") or "").split("->") if p)
    ]  # fmt: skip
    return f"series of members that left: {gone}" if gone else ""


@pytest.fixture
def monitored(smollm2_path: Path, tmp_path: Path) -> Iterator[Monitored]:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install --no-install-recommends prometheus)")
    if ALERTMANAGER is None:
        pytest.skip("no alertmanager (apt-get install --no-install-recommends prometheus-alertmanager)")
    from kafila.demo.fleet import LocalFleet

    listeners = [f"127.0.0.1:{free_port()}" for _ in range(4)]
    am_port = free_port()
    am = [ALERTMANAGER, f"--config.file={ALERTMANAGER_CONFIG}", f"--storage.path={tmp_path / 'alertmanager'}",
          f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="]  # fmt: skip
    with LocalFleet((None,) * 4, MODEL, context=512, workdir=tmp_path, stagger=False, wait_s=300,
                    extra_args=("--dead-after", "3", "--threads", "1"),
                    member_args=[["--metrics", a] for a in listeners]) as fleet:  # fmt: skip
        assert fleet.rendezvous_url is not None
        rendezvous = fleet.rendezvous_url.split("://", 1)[1].split("/", 1)[0]
        metrics = {m.name: a for m, a in zip(fleet.members, listeners, strict=True)}
        prom = tmp_path / "prometheus"
        prom.mkdir()
        config = prometheus_config(prom, rendezvous, metrics)
        body = yaml.safe_load(config.read_text())
        body["rule_files"] = [str(scaled_rules(prom / "rules.yml"))]
        [alerting] = body["alerting"]["alertmanagers"]  # the repository's block, this Alertmanager's address
        alerting["static_configs"] = [{"targets": [f"127.0.0.1:{am_port}"]}]
        config.write_text(yaml.safe_dump(body))
        port = free_port()
        argv = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={prom / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        with (
            running(am, tmp_path / "alertmanager.log", f"http://127.0.0.1:{am_port}/-/ready"),
            running(argv, prom / "prometheus.log", f"{base}/-/ready"),
        ):
            try:
                yield Monitored(fleet, metrics, base, f"http://127.0.0.1:{am_port}")
            finally:
                print(f"Prometheus's log: {prom / 'prometheus.log'}; the fleet's logs: {tmp_path}")


def test_a_killed_member_s_series_leave_the_new_ring_and_only_its_alerts_fire_and_resolve(
    monitored: Monitored,
) -> None:
    fleet, metrics, base = monitored.fleet, monitored.metrics, monitored.prometheus
    doc = fleet.session()
    ring1 = list(doc["ring"])
    assert doc["epoch"] == 1 and len(ring1) == 4
    traffic, watch = Traffic(fleet.url(doc["head"])), AlertWatch(base)
    threads = [threading.Thread(target=t.run, daemon=True) for t in (traffic, watch)]
    for t in threads:
        t.start()
    try:
        wait_for("every target up", lambda: [u["value"][1] for u in query(base, "up")] == ["1"] * 5, 60)
        wait_for("requests served", lambda: traffic.statuses.count(200) >= 3, 120)
        for name in ring1:
            wait_for(f"{name}'s series of epoch 1", lambda name=name: not describes(base, name, ring1, 1), 10)

        victim = next(m for m in fleet.members[1:] if m.name != doc["head"])
        killed_at = time.monotonic()
        victim.proc.send_signal(signal.SIGKILL)
        survivors = [n for n in ring1 if n != victim.name]

        def serving(name: str, epoch: int) -> bool:
            d = fleet.session(name)
            return bool(d.get("epoch") == epoch and d.get("state") == "serving")

        wait_for("epoch 2 serving at every survivor", lambda: all(serving(n, 2) for n in survivors), 180)
        ring2 = list(fleet.session()["ring"])
        assert sorted(ring2) == sorted(survivors)
        moved_at = time.monotonic()
        for name in survivors:  # within two scrapes (and 2 s for the queries on a loaded machine)
            wait_for(f"{name}'s series of the new ring", lambda n=name: not describes(base, n, ring2, 2),
                     max(0.5, moved_at + 2 * SCRAPE_S + 2 - time.monotonic()))  # fmt: skip
        wait_for("KafilaMemberDown and KafilaReplanned firing", lambda: watch.firing >= EXPECTED, 60)
        wait_for("both delivered to Alertmanager", lambda: delivered(monitored.alertmanager) >= EXPECTED, 30)

        back = fleet.add_member(victim.name, ("--metrics", metrics[victim.name]))
        wait_for(f"{back.name} answering scrapes",
                 lambda: query(base, f'up{{host="{back.name}"}}')[0]["value"][1] == "1", 60)  # fmt: skip
        wait_for("KafilaMemberDown resolved", lambda: "KafilaMemberDown" not in watch.firing, 30)
        window = 15 * 60 / TIME_SCALE  # KafilaReplanned's increase window
        wait_for("KafilaReplanned resolved", lambda: "KafilaReplanned" not in watch.firing, window + 60)
        false_slow = slower_than_predicted(base) if "KafilaStageSlowerThanPredicted" in watch.fired else []
        print(f"the loss to the new ring's series: {moved_at - killed_at:.1f} s; "
              f"requests: {traffic.statuses.count(200)} answered, {len(traffic.statuses)} sent; "
              f"alerts fired: {sorted(watch.fired)}")  # fmt: skip
    finally:
        traffic.stop()
        watch.stop()
        for t in threads:
            t.join(70)
    assert set(watch.fired) - {"KafilaStageSlowerThanPredicted"} == EXPECTED, (
        f"alerts fired: {sorted(watch.fired)}"
    )
    assert not false_slow, f"stages alerted slower than predicted that were not: {false_slow}"
    assert traffic.statuses.count(200) >= 3
