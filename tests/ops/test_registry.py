"""The operator's registry (ops.registry) with Debian's real docker-registry and the real Docker
engine: it starts on loopback, takes a pushed image once (a second push sends no layer), names its
config blob, and its log tells layers from the config and the rest. Hosts pulling through the ssh
tunnel are tested in the fleet lab (tests/ops/test_fleet_lab.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from ops.registry import LocalRegistry, registry_binary, served

pytestmark = [pytest.mark.docker]


def line(uri: str, written: int, status: int = 200, method: str = "GET") -> str:
    """One `response completed` event as docker-registry 2.8 logs it (formatter json)."""
    return json.dumps({
        "http.request.method": method, "http.request.uri": uri, "http.response.status": status,
        "http.response.written": written, "level": "info", "msg": "response completed",
    })  # fmt: skip


def test_the_log_counts_layers_apart_from_the_config_and_the_rest() -> None:
    lines = [
        line("/v2/", 2),
        line("/v2/kafila/member/manifests/cpu", 1_200),
        line("/v2/kafila/member/blobs/sha256:c0ffee", 4_575),  # the config
        line("/v2/kafila/member/blobs/sha256:aa", 79_424_285),
        line("/v2/kafila/member/blobs/sha256:bb", 0, status=307),  # a redirect sends no layer
        line("/v2/kafila/member/blobs/sha256:cc", 100, method="HEAD"),
        "not json",
        json.dumps({"msg": "listening on 127.0.0.1:5000"}),
    ]
    got = served(lines, "sha256:c0ffee")
    assert (got.layers, got.layer_bytes, got.total_bytes) == (1, 79_424_285, 2 + 1_200 + 4_575 + 79_424_285)


def docker_ready() -> None:
    if registry_binary() is None:
        pytest.skip("no docker-registry (apt-get install docker-registry)")
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode:
        pytest.skip("no running Docker engine")


def test_a_pushed_image_is_kept_once_and_its_config_named(tmp_path: Path) -> None:
    docker_ready()
    (tmp_path / "payload").write_bytes(b"kafila registry test\n" * 100)
    (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY payload /payload\n")
    image = "kafila/registry-test:one"
    built = subprocess.run(
        ["docker", "build", "-q", "-t", image, str(tmp_path)], capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    binary = registry_binary()
    assert binary is not None
    try:
        with LocalRegistry(binary, root=tmp_path / "registry") as registry:
            assert httpx.get(f"http://127.0.0.1:{registry.port}/v2/", timeout=5).status_code == 200
            mark = registry.log_mark()
            registry.push(image)
            config = registry.config_digest(image)
            assert config.startswith("sha256:")
            local = subprocess.run(
                ["docker", "image", "inspect", "-f", "{{.Id}}", image], capture_output=True, text=True
            )
            assert local.stdout.strip() == config  # the engine's image id is its config's digest
            first = registry.since(mark)
            assert any('"PUT"' in x and "/blobs/uploads/" in x for x in first)  # the layer went up
            mark = registry.log_mark()
            registry.push(image)  # again: the registry has every layer
            again = registry.since(mark)
            assert not any('"PUT"' in x and "/blobs/uploads/" in x for x in again), again
            refs = subprocess.run(
                ["docker", "images", "-q", registry.ref(image)], capture_output=True, text=True
            )
            assert refs.stdout.strip() == ""  # the registry's tag does not stay behind
        assert registry.proc.poll() is not None
    finally:
        subprocess.run(["docker", "rmi", image], capture_output=True)
