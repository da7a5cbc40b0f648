"""A member's or the rendezvous's own metrics listener (`--metrics HOST:PORT`): a thread that serves a
Prometheus registry on a port of its own, independent of the API and of the asyncio loop, so a
Prometheus elsewhere can scrape a member without reaching its API, and the metrics stay up while
the ring is broken or re-planning (the API may be off, or bound to localhost)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from kafila.obs.log import get_logger
from kafila.obs.metrics import REGISTRY

log = get_logger("kafila.obs.listener")


def parse_addr(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """ "HOST:PORT", ":PORT" or "PORT" -> (host, port); ValueError naming the text otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else default_host
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"metrics address {text!r} is not HOST:PORT (e.g. 0.0.0.0:9464)") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"metrics address {text!r}: port {number} is not 0-65535")
    return host or default_host, number


@dataclass
class MetricsListener:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        host = str(self.server.server_address[0])
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve_metrics(addr: str, registry: CollectorRegistry = REGISTRY) -> MetricsListener:
    """Serve `registry` at http://ADDR/metrics from a daemon thread; OSError (one line) when the
    address cannot be bound."""
    host, port = parse_addr(addr)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(f"metrics listener cannot bind {host}:{port}: {exc.strerror or exc}") from exc
    listener = MetricsListener(server, thread)
    log.info("metrics_listener_started", url=listener.url)
    return listener
