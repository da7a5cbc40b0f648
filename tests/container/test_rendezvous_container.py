"""The rendezvous image with the real Docker engine: `docker compose up` from the repository root,
healthy, used, down.

No Docker Hub and no index inside containers here. With Compose v2, `docker compose up -d rendezvous`
alone builds what it needs: its `prepare` service is a Compose provider (compose/kafila-prepare) that
makes the base image (debootstrap, cached by the engine), the wheelhouse (built on the host) and the
image, and says which step it is on. Debian's docker-compose v1 (where v2 is missing) runs those
scripts first and builds from compose/docker-compose.yml.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kafila.net.signaling import SignalingClient
from kafila.proto import udp
from kafila.proto.codes import new_code

pytestmark = [pytest.mark.docker, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = os.environ.get("KAFILA_BASE_IMAGE", "kafila/python-base:bookworm")
IMAGE = "kafila/rendezvous:test"


def run(*cmd: str, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return out.stdout


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def compose_cmd(project: str) -> list[str]:
    """`docker compose` (v2) reads compose.yaml at the root; v1 needs the file named."""
    v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60).returncode == 0
    if v2:
        return ["docker", "compose", "-p", project]
    return ["docker-compose", "-f", "compose/docker-compose.yml", "-p", project]


def require_engine() -> None:
    if shutil.which("docker") is None:
        pytest.skip("docker is not installed (CI installs docker.io and the compose v2 plugin)")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        pytest.skip(f"no running Docker engine (CI starts dockerd): {info.stderr.strip()[:200]}")
    have_base = subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True, timeout=60)
    if have_base.returncode != 0 and (os.geteuid() != 0 or shutil.which("debootstrap") is None):
        pytest.skip(f"base image {BASE_IMAGE} is missing and building it needs root and debootstrap")


@pytest.fixture(scope="module")
def compose_env() -> Iterator[dict[str, str]]:
    require_engine()
    env = {
        **os.environ,
        "KAFILA_BASE_IMAGE": BASE_IMAGE,
        "KAFILA_WHEELHOUSE": "wheelhouse",
        "KAFILA_RENDEZVOUS_IMAGE": IMAGE,
        "KAFILA_RENDEZVOUS_PORT": str(free_port(socket.SOCK_STREAM)),
        "KAFILA_UDP_PORT": str(free_port(socket.SOCK_DGRAM)),
        "KAFILA_UDP_ALT_PORT": str(free_port(socket.SOCK_DGRAM)),
    }
    compose = compose_cmd(f"kafilatest{os.getpid()}")
    env["COMPOSE_CMD"] = json.dumps(compose)
    try:
        if compose[1] == "compose":  # v2: nothing but `up`, the provider prepares and builds
            up = subprocess.run(
                [*compose, "up", "-d", "rendezvous"], cwd=ROOT, env=env, capture_output=True, text=True,
                timeout=1800,
            )  # fmt: skip
            assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
            said = [line for line in up.stderr.splitlines() if line.strip().startswith("prepare ")]
            for step in ("step 1/3 base image", "step 2/3 wheelhouse", f"step 3/3 image: building {IMAGE}"):
                assert any(step in line for line in said), said
        else:
            run("bash", "compose/build-base-image.sh", timeout=900)
            run("bash", "compose/build-wheelhouse.sh", timeout=900)
            run(*compose, "build", "rendezvous", env=env, timeout=900)
            run(*compose, "up", "-d", "rendezvous", env=env, timeout=300)
        yield env
    finally:
        subprocess.run(
            [*compose, "down", "-v", "--timeout", "5"], cwd=ROOT, env=env, capture_output=True, timeout=300
        )


def wait_healthy(env: dict[str, str], timeout: float = 90.0) -> dict[str, object]:
    compose = json.loads(env["COMPOSE_CMD"])
    cid = run(*compose, "ps", "-q", "rendezvous", env=env).strip()
    deadline = time.monotonic() + timeout
    state: dict[str, object] = {}
    while time.monotonic() < deadline:
        state = json.loads(run("docker", "inspect", "--format", "{{json .State}}", cid))
        health = state.get("Health") or {}
        if isinstance(health, dict) and health.get("Status") == "healthy":
            return state
        time.sleep(1.0)
    logs = run(*compose, "logs", "--tail", "30", "rendezvous", env=env)
    raise AssertionError(f"rendezvous not healthy after {timeout:.0f} s: {state}\n{logs}")


def test_compose_up_healthy_then_signaling_and_udp_probe(compose_env: dict[str, str]) -> None:
    state = wait_healthy(compose_env)
    assert state["Running"] is True
    config = json.loads(run("docker", "image", "inspect", "--format", "{{json .Config}}", IMAGE))
    assert config["User"] == "kafila"  # unprivileged
    port = int(compose_env["KAFILA_RENDEZVOUS_PORT"])
    udp_port = int(compose_env["KAFILA_UDP_PORT"])
    asyncio.run(signaling_round(f"ws://127.0.0.1:{port}/v1/signal", udp_port))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(3.0)
        txid = os.urandom(12)
        sock.sendto(udp.encode(udp.BindingRequest(txid)), ("127.0.0.1", udp_port))
        data, _ = sock.recvfrom(2048)
    reply = udp.decode(data)
    assert isinstance(reply, udp.BindingResponse) and reply.txid == txid
    assert reply.answered_from[1] == udp_port


def test_the_relay_secret_is_kept_in_its_volume_across_a_restart(compose_env: dict[str, str]) -> None:
    # the first start writes the secret into the volume; a restart reads the same one back, which
    # is what lets the relay take running sessions' channels back (docs/rendezvous.md, "Restarts")
    compose = json.loads(compose_env["COMPOSE_CMD"])
    wait_healthy(compose_env)
    run(*compose, "restart", "-t", "5", "rendezvous", env=compose_env, timeout=120)
    wait_healthy(compose_env)
    logs = run(*compose, "logs", "--no-color", "rendezvous", env=compose_env)
    events = [json.loads(line[line.index("{") :]) for line in logs.splitlines() if '"relay_secret"' in line]
    assert [e["created"] for e in events] == [True, False]
    assert {e["path"] for e in events} == {"/var/lib/kafila/relay.key"}


async def signaling_round(url: str, udp_port: int) -> None:
    async with await SignalingClient.connect(url) as host:
        opened = await host.open_session("smollm2-135m", 2, "container-test-host", {"memory_gb": 1})
        assert opened.probe_port == udp_port
        code = new_code(opened.session)
        await host.protect(code)  # joins prove the code's secret (signaling v2)
        async with await SignalingClient.connect(url) as guest:
            joined = await guest.join(code, "container-test-guest", {})
            assert [m.name for m in joined.members] == ["container-test-host", "container-test-guest"]
            await guest.signal(1, {"hello": "through the container"})
            await host.next_event(5.0)  # member_joined
            assert (await host.next_event(5.0)).payload == {"hello": "through the container"}  # type: ignore[union-attr]
