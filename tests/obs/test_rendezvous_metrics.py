"""The rendezvous's metrics on a listener of its own (`--metrics`), linted by promtool."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

import kafila
from kafila.net.signaling import SignalingClient, SignalingError
from kafila.proto.codes import WORDS, new_code
from kafila.rendezvous.server import RendezvousServer, ServerConfig
from tests.obs.promtool import PROMTOOL, check_metrics, needs_promtool
from tests.obs.test_metrics import value

CAP = {"bandwidth_gbs": 20.0, "memory_gb": 16}


async def test_the_metrics_listener_serves_joins_by_outcome_and_promtool_finds_it_clean() -> None:
    config = ServerConfig(host="127.0.0.1", port=0, udp_port=0, udp_alt_port=0, metrics="127.0.0.1:0")
    server = RendezvousServer(config)
    await server.start()
    try:
        assert server.metrics is not None
        host = await SignalingClient.connect(server.url)
        opened = await host.open_session("m", 3, "h", CAP)
        code = new_code(opened.session)
        await host.protect(code)
        guest = await SignalingClient.connect(server.url)
        await guest.join(code, "g", CAP)
        *words, last = str(code).split("-")
        wrong = "-".join([*words, next(w for w in WORDS if w != last)])
        with pytest.raises(SignalingError, match="wrong_secret"):
            await SignalingClient.join(await SignalingClient.connect(server.url), wrong, "g2", CAP)
        async with httpx.AsyncClient() as http:
            exposed = (await http.get(server.metrics.url)).content
            same = (await http.get(f"http://127.0.0.1:{server.http_port}/metrics")).text
        text = exposed.decode()
        assert (
            value(text, "kafila_rendezvous_sessions") == 1 and value(text, "kafila_rendezvous_members") == 2
        )
        assert value(text, "kafila_rendezvous_joins_total", outcome="ok") == 1
        assert value(text, "kafila_rendezvous_build_info", version=kafila.__version__) == 1
        assert (
            sum(
                value(text, "kafila_rendezvous_joins_total", outcome=o)
                for o in ("wrong_secret", "bad_code", "unknown_session")
            )
            == 1
        )
        assert value(text, "kafila_rendezvous_relay_channels_limit") == 4096
        assert value(text, "process_resident_memory_bytes") > 0
        assert value(same, "kafila_rendezvous_sessions") == 1  # the signaling port's /metrics says the same
        if PROMTOOL is not None:
            assert check_metrics(exposed) == ""
        await host.close()
        await guest.close()
    finally:
        url = server.metrics.url if server.metrics else ""
        await server.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=2)


@needs_promtool
async def test_promtool_finds_a_fresh_rendezvous_clean() -> None:
    server = RendezvousServer(ServerConfig(host="127.0.0.1", port=0, udp_port=0, udp_alt_port=0))
    await server.start()
    try:
        async with httpx.AsyncClient() as http:
            exposed = (await http.get(f"http://127.0.0.1:{server.http_port}/metrics")).content
    finally:
        await server.stop()
    assert check_metrics(exposed) == ""


def test_a_bad_metrics_address_is_refused_before_anything_starts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kafila", "rendezvous", "--metrics", "nowhere:port"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "'nowhere:port' is not HOST:PORT" in done.stderr
