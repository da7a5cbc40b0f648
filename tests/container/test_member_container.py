"""The member image (Dockerfile.cuda, VARIANT=cpu) with the real Docker engine: a containerized member
(`docker run --network host ... join CODE`) joins a native `kafila host` started here and serves.

Built as CI builds it (tests/container/images.py), once per test session: the fleet lab uses it too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.container.test_rendezvous_container import ROOT, free_port, run

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.network]
MODEL = "smollm2-135m"


def test_the_image_is_the_cpu_variant_unprivileged_with_a_model_cache_volume(member_image: str) -> None:
    import json

    config = json.loads(run("docker", "image", "inspect", "--format", "{{json .Config}}", member_image))
    assert config["User"] == "kafila"
    assert "/var/cache/kafila" in config["Volumes"]
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility" and env["KAFILA_VARIANT"] == "cpu"
    out = run("docker", "run", "--rm", member_image, "probe", "--help")
    assert "usage: kafila probe" in out


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def test_a_containerized_member_joins_a_native_host_and_serves(
    member_image: str, smollm2_path: Path, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    port, udp, alt = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM)
    host_api, member_api = free_port(socket.SOCK_STREAM), free_port(socket.SOCK_STREAM)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KAFILA_LOG": "json"}
    kafila = [sys.executable, "-m", "kafila"]
    logs = {name: (tmp_path / f"{name}.log").open("wb") for name in ("rdv", "host")}
    processes.append(
        subprocess.Popen(
            [
                *kafila,
                "rendezvous",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--udp-port",
                str(udp),
                "--udp-alt-port",
                str(alt),
            ],
            env=env,
            stdout=logs["rdv"],
            stderr=subprocess.STDOUT,
        )
    )
    logs["rdv"].close()  # the child has its own descriptor
    code_file = tmp_path / "code"
    processes.append(
        subprocess.Popen(
            [
                *kafila,
                "host",
                "--model",
                MODEL,
                "--members",
                "2",
                "--context",
                "512",
                "--name",
                "native",
                "--rendezvous",
                f"127.0.0.1:{port}",
                "--api",
                f"127.0.0.1:{host_api}",
                "--code-file",
                str(code_file),
                "--threads",
                "1",
            ],
            env=env,
            stdout=logs["host"],
            stderr=subprocess.STDOUT,
        )
    )
    logs["host"].close()
    deadline = time.monotonic() + 180
    while not code_file.exists():
        assert time.monotonic() < deadline, (tmp_path / "host.log").read_text()[-3000:]
        assert processes[1].poll() is None, (tmp_path / "host.log").read_text()[-3000:]
        time.sleep(0.5)
    code = code_file.read_text().strip()
    name = f"kafila-test-member-{os.getpid()}"
    run(
        "docker", "run", "-d", "--name", name, "--network", "host", "--label", "dev.kafila.fleet=test",
        member_image, "join", code, "--rendezvous", f"127.0.0.1:{port}", "--api", f"127.0.0.1:{member_api}",
        "--name", "container", "--threads", "1",
    )  # fmt: skip
    try:
        doc: dict[str, Any] = {}
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                doc = httpx.get(f"http://127.0.0.1:{host_api}/session", timeout=5).json()
            except httpx.HTTPError:
                doc = {}
            if doc.get("state") == "serving":
                break
            state = run("docker", "inspect", "--format", "{{.State.Status}}", name).strip()
            assert state == "running", run("docker", "logs", "--tail", "40", name)
            time.sleep(2)
        assert doc.get("state") == "serving", (doc, run("docker", "logs", "--tail", "40", name))
        assert doc["ring"] and set(doc["ring"]) == {"native", "container"}
        mine = httpx.get(
            f"http://127.0.0.1:{member_api}/session", timeout=5
        ).json()  # the container's own API
        assert mine["state"] == "serving" and mine["me"] == "container"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 12, "temperature": 0}  # fmt: skip
        answer = httpx.post(f"http://127.0.0.1:{member_api}/v1/chat/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        assert "Paris" in answer.json()["choices"][0]["message"]["content"]
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
