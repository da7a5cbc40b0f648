"""Run the rendezvous: UDP probes + relay and the signaling app under uvicorn, in one event loop.

`RendezvousServer(config)`: `await start()` binds everything (port 0 picks a free port; the bound
ports are then in `http_port`, `udp.port`, `udp.alt_port`), `await stop()` shuts it down.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette

from kafila.net.tcp import STOP_GRACE_S, bind_tcp
from kafila.obs.listener import MetricsListener, serve_metrics
from kafila.obs.log import get_logger
from kafila.proto import signaling
from kafila.proto.udp import format_address
from kafila.rendezvous.app import build_app
from kafila.rendezvous.limits import Limits
from kafila.rendezvous.metrics import make_registry
from kafila.rendezvous.registry import ProbeInfo, Registry
from kafila.rendezvous.relay import RelayTable
from kafila.rendezvous.udp import ListenError, UdpService

log = get_logger("kafila.rendezvous")


class TlsError(Exception):
    """The certificate or key cannot serve TLS; the text names the file and the reason."""


def check_tls(cert: str, key: str) -> None:
    """Load `cert` and `key` as uvicorn will, raising TlsError naming the flag and file at fault."""
    for flag, path in (("--cert", cert), ("--key", key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise TlsError(f"cannot load {flag} {path}: {exc.strerror or exc}") from exc
    try:
        ssl.create_default_context().load_verify_locations(cafile=cert)
    except ssl.SSLError as exc:
        raise TlsError(f"cannot load --cert {cert}: it holds no PEM certificate ({exc.reason})") from exc

    def encrypted() -> str:
        raise TlsError(f"cannot load --key {key}: it is encrypted; give an unencrypted PEM key")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=encrypted)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            why = "the key does not belong to the certificate"
        elif exc.library == "SSL" and "PEM lib" in str(exc):  # the certificate loaded above: the key
            raise TlsError(f"cannot load --key {key}: it holds no PEM private key") from exc
        else:
            why = str(exc.reason or exc)
        raise TlsError(f"cannot load --cert {cert} / --key {key}: {why}") from exc


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"  # signaling (HTTP/WebSocket) address
    port: int = signaling.DEFAULT_PORT
    udp_host: str | None = None  # probe/relay address; default: `host`
    udp_port: int = 3478
    udp_alt_port: int = 3479
    udp_alt_host: str | None = None  # a second address for "reply from other address"
    advertise_alt_host: str | None = None  # alt address as members reach it (default udp_alt_host)
    cert: str | None = None  # PEM certificate chain: serve wss directly
    key: str | None = None
    forwarded_allow_ips: str | None = None  # trust X-Forwarded-For from these proxies
    limits: Limits = field(default_factory=Limits)
    tick_s: float = 1.0
    relay_secret: bytes | None = None  # signs relay leg tokens; kept across restarts: channels too
    metrics: str | None = None  # HOST:PORT of a metrics listener of its own (besides /metrics on `port`)


class RendezvousServer:
    def __init__(self, config: ServerConfig, handle_signals: bool = False) -> None:
        self.config = config
        self.handle_signals = handle_signals
        self.relay = RelayTable(config.limits, config.relay_secret, started=time.monotonic())
        self.udp = UdpService(self.relay)  # the same clock: time.monotonic
        self.registry: Registry | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.http_port = 0
        self.metrics: MetricsListener | None = None

    async def start(self) -> None:
        cfg = self.config
        if cfg.cert and cfg.key:
            check_tls(cfg.cert, cfg.key)  # before binding anything
        await self.udp.start(cfg.udp_host or cfg.host, cfg.udp_port, cfg.udp_alt_port, cfg.udp_alt_host)
        alt_host = cfg.advertise_alt_host or cfg.udp_alt_host or None
        probe = ProbeInfo(self.udp.port, self.udp.alt_port, alt_host)
        # the relay secret, when kept across restarts (--relay-secret-file), also signs re-open tickets
        self.registry = Registry(cfg.limits, self.relay, probe, kept_secret=cfg.relay_secret)
        app = build_app(self.registry, self.udp.stats, tick_s=cfg.tick_s)
        try:
            sock = bind_tcp(cfg.host, cfg.port)
        except OSError as exc:
            self.udp.close()
            where = format_address((cfg.host, cfg.port))
            raise ListenError(exc.errno, f"cannot listen on TCP {where}: {exc.strerror}", "port") from exc
        self.http_port = sock.getsockname()[1]
        if cfg.metrics is not None:
            try:
                self.metrics = serve_metrics(cfg.metrics, make_registry(self.registry, self.udp.stats))
            except OSError as exc:
                sock.close()
                self.udp.close()
                raise ListenError(exc.errno, str(exc), "metrics") from exc
        self._server = uvicorn.Server(self._uvicorn_config(app))
        # uvicorn's serve() captures SIGINT/SIGTERM (wanted by the CLI); embedded servers (tests, demo)
        # leave signals to their host process.
        serve = self._server.serve if self.handle_signals else self._server._serve
        self._task = asyncio.create_task(serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self.udp.close()
                await self._task  # raises what went wrong
                raise RuntimeError("rendezvous HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        log.info(
            "rendezvous_started",
            url=self.url,
            udp_port=self.udp.port,
            udp_alt_port=self.udp.alt_port,
            # a kept secret (--relay-secret-file): sessions and relay channels outlive a restart
            sessions_outlive_restart=cfg.relay_secret is not None,
        )

    def _uvicorn_config(self, app: Starlette) -> uvicorn.Config:
        cfg = self.config
        return uvicorn.Config(
            app,
            ssl_certfile=cfg.cert,
            ssl_keyfile=cfg.key,
            ws="websockets-sansio",
            ws_max_size=max(4 * cfg.limits.max_message_bytes, signaling.MAX_MESSAGE_BYTES),
            ws_ping_interval=20.0,
            ws_ping_timeout=20.0,
            proxy_headers=cfg.forwarded_allow_ips is not None,
            forwarded_allow_ips=cfg.forwarded_allow_ips,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=STOP_GRACE_S,
        )

    @property
    def url(self) -> str:
        scheme = "wss" if self.config.cert else "ws"
        host = self.config.host if self.config.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"{scheme}://{format_address((host, self.http_port))}{signaling.SIGNAL_PATH}"

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._close_metrics()
        self.udp.close()

    def _close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    async def serve_forever(self) -> None:
        await self.start()
        try:
            assert self._task is not None
            await self._task
        finally:
            self._close_metrics()
            self.udp.close()
