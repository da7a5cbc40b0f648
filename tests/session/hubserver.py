"""A local HTTP server laid out like the Hugging Face hub: `/{org}/{repo}/resolve/{revision}/{file}`
serves a checkpoint folder's files, honouring `Range` (206), with an optional bearer token (401
without it) and, for tests that say "simulated corruption", a byte it flips in what it sends."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Hub:
    folder: Path
    repo: str = "kafila/tiny"
    revision: str = "main"
    token: str | None = None
    flip: tuple[str, int] | None = None  # (file, absolute offset): served with its lowest bit flipped
    served: dict[str, int] = field(default_factory=dict)  # file -> bytes sent
    refused: int = 0
    port: int = 0

    @property
    def url(self) -> str:
        """The folder URL of the revision's files, as `--weights-from` takes a pinned hub URL."""
        return f"http://127.0.0.1:{self.port}/{self.repo}/resolve/{self.revision}"


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            prefix = f"/{hub.repo}/resolve/{hub.revision}/"
            path = hub.folder / self.path.removeprefix(prefix)
            if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                hub.refused += 1
                self.send_error(401, "token needed")
                return
            if not self.path.startswith(prefix) or not path.is_file() or "/" in self.path[len(prefix) :]:
                self.send_error(404)
                return
            data = path.read_bytes()
            a, b, status = 0, len(data), 200
            if m := re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", "")):
                a, b, status = int(m[1]), min(len(data), int(m[2]) + 1), 206
            body = bytearray(data[a:b])
            if hub.flip is not None and hub.flip[0] == path.name and a <= hub.flip[1] < b:
                body[hub.flip[1] - a] ^= 1
            hub.served[path.name] = hub.served.get(path.name, 0) + len(body)
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            if status == 206:
                self.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(data)}")
            self.end_headers()
            self.wfile.write(body)

    return Handler


@contextmanager
def serving(hub: Hub) -> Iterator[Hub]:
    """`hub` answering on a loopback port (hub.port) until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
