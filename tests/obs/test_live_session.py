"""Observability against a real session: a rendezvous and three members on loopback
(kafila.demo.fleet), started once for this module and stopped when it ends. Prometheus scrapes each
member on its own metrics listener (`kafila host|join --metrics`), as a fleet's `monitor` does.

- The Grafana dashboards and the alert rules, proven against Debian's `prometheus` scraping the
  session every second: after a few requests every panel's and every rule's PromQL parses
  (promql-parser), names only metrics Kafila exports, and returns data; `promtool check metrics` is
  clean on every member and on the rendezvous. Grafana itself is in no registry here: the dashboards'
  JSON is what Grafana would send to this Prometheus.
- The member page in Debian's headless Chromium, on a member whose API asks for a key: the page asks
  for it, keeps it for the tab, then the DOM shows the members, the epoch and a streamed answer, and
  no table is clipped in a 1280 px window; a screenshot is kept (its path is printed); with
  KAFILA_DOCS_SCREENSHOTS=1 it replaces the one the guide shows, docs/images/member-page.png."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import promql_parser as pp
import pytest
import yaml

from tests.obs.cdp import BROWSER, Browser
from tests.obs.promtool import PROMTOOL, check_metrics
from tests.obs.test_dashboards import (
    AWAITING_SESSION_WIRING,
    LIVE_DASHBOARDS,
    PROMETHEUS,
    ROOT,
    RULES,
    defined_metrics,
    metric_names,
    panel_queries,
    rule_queries,
    selectors,
    substitute,
)

DOCS_SCREENSHOTS = "KAFILA_DOCS_SCREENSHOTS"
DOCS_IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"


@dataclass(frozen=True)
class LiveSession:
    rendezvous: str  # HOST:PORT of its signaling port (which serves /metrics)
    members: dict[str, str]  # name -> HOST:PORT of its API (which serves /metrics and the page)
    metrics: dict[str, str]  # name -> HOST:PORT of its own metrics listener (--metrics)
    head: str
    workdir: Path
    keys: dict[str, str]  # name -> its API key

    def url(self, name: str) -> str:
        return f"http://{self.members[name]}"

    def headers(self, name: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[name]}"} if name in self.keys else {}


@pytest.fixture(scope="module")
def live_session(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[LiveSession]:
    from kafila.demo.fleet import LocalFleet  # the one import of the harness (it may move)

    workdir = tmp_path_factory.mktemp("live-session")
    listeners = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    member_args = [["--metrics", addr] for addr in listeners]
    key = f"live-session-{secrets.token_hex(12)}"  # every member's API asks for it
    with LocalFleet([None] * 3, context=256, workdir=workdir, wait_s=240, member_args=member_args,
                    api_key=key) as fleet:  # fmt: skip
        assert fleet.rendezvous_url is not None
        rendezvous = fleet.rendezvous_url.split("://", 1)[1].split("/", 1)[0]
        members = {name: url.split("://", 1)[1] for name, url in fleet.api_urls.items()}
        metrics = {m.name: addr for m, addr in zip(fleet.members, listeners, strict=True)}
        keys = dict.fromkeys(members, key)
        yield LiveSession(rendezvous, members, metrics, fleet.head, workdir, keys)


@dataclass
class Scraped:
    prometheus: str  # base URL of the Prometheus API
    exported: set[str]  # every metric name the session's processes expose
    expositions: dict[str, bytes]  # target -> its /metrics text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prometheus_config(tmp: Path, rendezvous: str, members: dict[str, str]) -> Path:
    """The repository's prometheus.yml, made local: a 1 s scrape, the fleet's own addresses."""
    config = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(RULES)]
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    jobs["kafila-rendezvous"]["static_configs"][0]["targets"] = [rendezvous]
    targets = tmp / "targets"
    targets.mkdir()
    sd = [{"targets": [addr], "labels": {"site": "loopback", "host": name}} for name, addr in members.items()]
    (targets / "members.yml").write_text(yaml.safe_dump(sd))
    jobs["kafila-members"]["file_sd_configs"][0]["files"] = [str(targets / "*.yml")]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def query(base: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return list(body["data"]["result"])


def prometheus_ready(base: str, within: float = 60) -> None:
    """Wait for Prometheus's /-/ready (it answers 503 "Service Unavailable" while its storage starts,
    and refuses connections before it listens)."""

    def ready() -> bool:
        try:
            return httpx.get(f"{base}/-/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for("Prometheus ready", ready, within)


def wait_for(what: str, ok: Any, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} within {within:.0f} s")


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory, live_session: LiveSession) -> Iterator[Scraped]:
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install --no-install-recommends prometheus)")
    tmp = tmp_path_factory.mktemp("prometheus")
    live = live_session
    port = free_port()
    argv = [PROMETHEUS, f"--config.file={prometheus_config(tmp, live.rendezvous, live.metrics)}",
            f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    with (tmp / "prometheus.log").open("wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            prometheus_ready(base)
            body = {"model": "smollm2-135m", "max_tokens": 8, "temperature": 0}
            ask = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
            for i, name in enumerate([*live.members, live.head]):  # at every member's API, one streamed
                r = httpx.post(f"{live.url(name)}/v1/chat/completions", json=body | ask | {"stream": i == 0},
                               headers=live.headers(name), timeout=120)  # fmt: skip
                assert r.status_code == 200, r.text

            def all_up() -> bool:
                try:
                    ups = query(base, "up")
                except (httpx.HTTPError, AssertionError):
                    return False
                return len(ups) == 4 and all(u["value"][1] == "1" for u in ups)

            wait_for("Prometheus scraping the rendezvous and three members", all_up, 60)
            time.sleep(3)  # a few scrapes after the requests: rates over them
            apis = [(addr, live.headers(name)) for name, addr in live.members.items()]
            expositions = {
                target: httpx.get(f"http://{target}/metrics", headers=headers, timeout=10).content
                for target, headers in [
                    (live.rendezvous, {}),
                    *((a, {}) for a in live.metrics.values()),
                    *apis,
                ]
            }
            exported = {
                r["metric"]["__name__"] for r in query(base, 'count by (__name__) ({__name__=~".+"})')
            }
            yield Scraped(base, exported, expositions)
        finally:
            server.terminate()
            server.wait(timeout=30)
            print(f"Prometheus's log: {tmp / 'prometheus.log'}")


@pytest.mark.slow
@pytest.mark.network
def test_promtool_finds_every_member_and_the_rendezvous_clean(scraped: Scraped) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (apt-get install --no-install-recommends prometheus)")
    for target, text in scraped.expositions.items():
        assert check_metrics(text) == "", f"{target}: {check_metrics(text)}"


@pytest.mark.slow
@pytest.mark.network
def test_every_panel_names_exported_metrics_and_returns_data(scraped: Scraped) -> None:
    """The live dashboards; the Bench run reads the series `fleet traces` backfills, which a live
    session does not export (tests/ops/test_observe.py runs it against backfilled blocks)."""
    empty = []
    for path in LIVE_DASHBOARDS:
        for where, expr in panel_queries(path):
            expr = substitute(expr)
            names = metric_names(expr)
            unfed = names - scraped.exported
            assert unfed <= AWAITING_SESSION_WIRING, f"{where}: {sorted(unfed)} not exported"
            assert unfed <= defined_metrics(), (
                f"{where}: {sorted(unfed)} defined nowhere in kafila.obs.metrics"
            )
            if not query(scraped.prometheus, expr):
                empty.append((where, names))
    unexplained = [(w, n) for w, n in empty if not n & AWAITING_SESSION_WIRING]
    assert not unexplained, f"panels without data: {unexplained}"
    print(f"panels awaiting the session's wiring: {[w for w, _ in empty]}")


@pytest.mark.slow
@pytest.mark.network
def test_every_rule_names_exported_metrics_with_live_series(scraped: Scraped) -> None:
    """A rule is silent on a healthy session, so its whole expression is rightly empty: each series
    it selects must have data (with the rule's own label matchers where they select a live state)."""
    for where, expr in rule_queries():
        for vs in selectors(pp.parse(expr)):
            assert vs.name in scraped.exported, f"{where}: {vs.name} not exported"
            assert query(scraped.prometheus, f"{vs.name}"), f"{where}: no series {vs.name}"
    alerts = httpx.get(f"{scraped.prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    health = {r["name"]: r["health"] for g in alerts for r in g["rules"]}
    assert set(health.values()) == {"ok"}, health  # every rule evaluated without error


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium (apt-get install chromium-headless-shell)")
def test_the_page_in_a_real_browser_shows_the_ring_and_streams_an_answer(
    live_session: LiveSession, tmp_path: Path
) -> None:
    live = live_session
    member = next(name for name in live.members if name != live.head)  # a member that is not the head
    browser = Browser(tmp_path / "chromium.log")
    try:
        browser.navigate(live.url(member) + "/")
        browser.wait_for("!document.getElementById('key-form').hidden", 30)  # /session answered 401
        assert browser.evaluate("document.getElementById('state').textContent") == "needs a key"
        browser.evaluate(
            f"document.getElementById('api-key').value = {live.keys[member]!r};"
            "document.getElementById('key-form').requestSubmit(); true"
        )
        browser.wait_for("document.querySelectorAll('#members tbody tr').length === 3", 30)
        assert browser.evaluate("sessionStorage.getItem('kafila-api-key')") == live.keys[member]
        assert browser.evaluate("document.getElementById('key-form').hidden")
        change = browser.evaluate("document.getElementById('change').textContent")
        assert change.startswith("epoch 1"), change
        shown = browser.evaluate(
            "[...document.querySelectorAll('#members tbody tr')].map(r => r.dataset.member)"
        )
        assert sorted(shown) == sorted(live.members)
        assert browser.evaluate("document.getElementById('state').textContent") == "serving"
        edges = browser.evaluate("[...document.querySelectorAll('#edges tbody tr')].map(r => r.innerText)")
        assert len(edges) == 3 and all("direct" in e for e in edges), edges
        head_row = browser.evaluate(
            f"document.querySelector('#members tr[data-member=\"{live.head}\"]').innerText"
        )
        assert "head" in head_row
        browser.evaluate(
            "document.getElementById('prompt').value = 'What is the capital of France?';"
            "document.getElementById('temperature').value = '0';"  # greedy: the answer is fixed
            "document.getElementById('max-tokens').value = '16';"
            "document.getElementById('chat').requestSubmit(); true"
        )
        done = browser.wait_for("document.getElementById('chat-status').dataset.done", 120)
        status = browser.evaluate("document.getElementById('chat-status').textContent")
        answer = browser.evaluate("document.getElementById('answer').textContent")
        assert done == "1", status
        chunks = int(re.findall(r"streamed in (\d+) chunks", status)[0])
        assert "Paris" in answer and chunks > 1, (answer, status)  # streamed, chunk by chunk
        # the page re-reads /traces after the answer: this member measured its stage
        mine = f"document.querySelector('#members tr[data-member=\"{member}\"] td.measured').textContent"
        browser.wait_for(f"/ ms$/.test({mine})", 30)
        clipped = browser.evaluate(  # in the 1280 px window: no table wider than its section
            "[...document.querySelectorAll('table')].filter(t => t.scrollWidth > t.parentElement.clientWidth)"
            ".map(t => t.id).concat(document.documentElement.scrollWidth > 1280 ? ['page'] : [])"
        )
        assert clipped == [], clipped
        shot = browser.screenshot(tmp_path / "member-page.png")
    finally:
        browser.close()
    assert shot.stat().st_size > 10_000
    print(f"screenshot of {member}'s page: {shot}")
    if os.environ.get(DOCS_SCREENSHOTS) == "1":  # the picture the guide shows, made by this test
        kept = DOCS_IMAGES / "member-page.png"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, kept)
        print(f"kept for the docs: {kept}")
    assert httpx.get(live.url(member) + "/", timeout=10).text.startswith("Kafila is running")
