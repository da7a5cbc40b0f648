"""A real Prometheus on the TSDB blocks `kafila-ops fleet traces` backfilled, answering the Bench run
dashboard's queries (Grafana's variables filled in as tests/obs/test_dashboards.py fills them)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import promql_parser as pp

from tests.obs.test_dashboards import BACKFILLED_DASHBOARDS, panel_queries, substitute

PROMETHEUS = shutil.which("prometheus")


def bench_run_answers(tsdb: Path) -> dict[str, int]:
    """Start Prometheus on `tsdb` and run every Bench run query (every panel target and variable):
    where -> the number of series it returned. A query Prometheus rejects fails the caller."""
    assert PROMETHEUS is not None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tsdb.parent / "prometheus-backfill.yml"
    config.write_text("global:\n  scrape_interval: 1h\n")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}/api/v1/query"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base, params={"query": "vector(1)"}, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not answer within 60 s"
            time.sleep(0.5)
        answers = {}
        for path in BACKFILLED_DASHBOARDS:
            for where, expr in panel_queries(path):
                expr = substitute(expr)
                pp.parse(expr)
                r = httpx.get(base, params={"query": expr}, timeout=30)
                body = r.json()
                assert r.status_code == 200 and body["status"] == "success", f"{where}: {expr}: {body}"
                answers[where] = len(body["data"]["result"])
        return answers
    finally:
        proc.terminate()
        proc.wait(timeout=30)
