"""The member page at `/`: served for browsers (no external resource), the Ollama-style line for
other clients; and in a real headless Chromium, loaded from a running session's member, it shows the
members and streams an answer."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from kafila.api import page
from tests.obs.cdp import BROWSER, Browser
from tests.obs.conftest import LiveSession

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@pytest.fixture
def client() -> TestClient:
    app = Starlette(routes=[Route("/", page.root), Route(page.ASSET_PATH, page.asset)])
    return TestClient(app)


def test_a_browser_gets_the_page_and_every_other_client_the_line_ollama_answers(client: TestClient) -> None:
    html = client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert '<table id="members">' in html.text and '<form id="chat">' in html.text
    for accept in ("*/*", "application/json", ""):
        plain = client.get("/", headers={"Accept": accept})
        assert plain.status_code == 200 and plain.text.startswith("Kafila is running (OpenAI API at /v1")
    assert client.head("/").status_code == 200


def test_the_page_needs_nothing_from_outside_the_member(client: TestClient) -> None:
    html = client.get("/", headers={"Accept": BROWSER_ACCEPT}).text
    linked = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert linked and all(url.startswith("/") for url in linked), linked  # no CDN, no other host
    for url in linked:
        if url.startswith("/_kafila/"):
            got = client.get(url)
            assert got.status_code == 200 and "http://" not in got.text and "https://" not in got.text, url
    assert client.get("/_kafila/secrets.txt").status_code == 404


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
        browser.wait_for("document.querySelectorAll('#members tbody tr').length === 3", 30)
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
        browser.wait_for("[...document.querySelectorAll('#members tbody td')].some(td => /ms$/.test("
                         "td.textContent) && td.cellIndex === 5)", 30)  # fmt: skip
        shot = browser.screenshot(tmp_path / "member-page.png")
    finally:
        browser.close()
    assert shot.stat().st_size > 10_000
    print(f"screenshot of {member}'s page: {shot}")
    assert httpx.get(live.url(member) + "/", timeout=10).text.startswith("Kafila is running")
