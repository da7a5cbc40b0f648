"""`kafila trace summarize` reads standard input (`-`) and a member's /traces document as well as
files, and ends quietly when its output is closed (`... | head`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kafila.cli import main as cli_main
from kafila.obs.trace import TraceLog
from tests.obs.test_trace import request, session, stage

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def trace_file(tmp_path: Path) -> tuple[Path, TraceLog]:
    path = tmp_path / "trace.jsonl"
    log = TraceLog(path)
    for r in [session(), request(1, (10, 10, 20)), request(2, (10, 10, 20), 2.0), stage(2, "a", 9.0)]:
        log.write(r)
    return path, log


def kafila(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "kafila", *args], input=stdin, capture_output=True,
                          env=ENV, timeout=120, check=False)  # fmt: skip


def test_standard_input_summarises_as_the_file_does(tmp_path: Path) -> None:
    path, _ = trace_file(tmp_path)
    from_file = kafila("trace", "summarize", str(path), "--json")
    from_stdin = kafila("trace", "summarize", "-", "--json", stdin=path.read_bytes())
    assert from_stdin.returncode == 0 and from_stdin.stdout == from_file.stdout
    assert json.loads(from_stdin.stdout)["table_iv"][0]["bottleneck_member"] == "c"
    empty = kafila("trace", "summarize", "-", stdin=b"")
    assert empty.returncode == 1 and b"kafila trace: standard input holds no finished request" in empty.stderr


@pytest.fixture
def traces_server(tmp_path: Path) -> Iterator[str]:
    """An HTTP server answering /traces as a member does ({"traces": TraceLog.recent()})."""
    _, log = trace_file(tmp_path)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/traces":
                body, status = json.dumps({"traces": log.recent()}).encode(), 200
            elif self.path == "/notjson/traces":
                body, status = b"<html>hello</html>", 200
            else:
                body, status = b'{"error": "no route"}', 404
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_a_members_traces_document_summarises_as_its_file_does(
    traces_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"  # the file the same log wrote
    assert cli_main(["trace", "summarize", str(path), "--json"]) == 0
    from_file = capsys.readouterr().out
    for url in (f"{traces_server}/traces", traces_server, f"{traces_server}/"):  # the API's base URL too
        assert cli_main(["trace", "summarize", url, "--json"]) == 0
        assert capsys.readouterr().out == from_file


def test_a_url_that_is_not_a_traces_document_is_named(
    traces_server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["trace", "summarize", f"{traces_server}/elsewhere/traces"]) == 1
    assert "/elsewhere/traces: HTTP 404" in capsys.readouterr().err
    assert cli_main(["trace", "summarize", f"{traces_server}/notjson"]) == 1
    assert "not a /traces document (not JSON)" in capsys.readouterr().err
    assert cli_main(["trace", "summarize", "http://127.0.0.1:9/traces"]) == 1  # nothing listens on 9
    assert "cannot read it" in capsys.readouterr().err


def test_a_closed_output_ends_it_quietly(tmp_path: Path) -> None:
    """`kafila trace summarize FILE | head` raised BrokenPipeError: the reader here closes the pipe
    before the command writes anything, so every write meets a closed pipe."""
    path, _ = trace_file(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "kafila", "trace", "summarize", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 0 and err == ""
