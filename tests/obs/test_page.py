"""The member page at `/`: served for browsers (no external resource), the Ollama-style line for
other clients. In a real headless Chromium on a running session: tests/obs/test_live_session.py."""

from __future__ import annotations

import re

import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from kafila.api import page

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
