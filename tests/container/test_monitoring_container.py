"""The compose `monitoring` profile with the real Docker engine and no registry: Prometheus and
Alertmanager built from Debian's packages on the local base image (compose/monitoring.Dockerfile),
started from the repository root as a user would, Prometheus running the repository's rules and
sending to the Alertmanager service by name."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.container.test_rendezvous_container import BASE_IMAGE, compose_cmd, free_port, require_engine, run
from tests.obs.test_dashboards import RULES

pytestmark = [pytest.mark.docker, pytest.mark.slow]
IMAGES = {"prometheus": "kafila/prometheus:test", "alertmanager": "kafila/alertmanager:test"}


@pytest.fixture(scope="module")
def monitoring() -> Iterator[tuple[str, str]]:
    """(Prometheus's base URL, Alertmanager's) of the profile brought up from the repository root."""
    require_engine()
    import os

    ports = {name: free_port(socket.SOCK_STREAM) for name in ("prometheus", "alertmanager")}
    env = {
        **os.environ,
        "KAFILA_BASE_IMAGE": BASE_IMAGE,
        "KAFILA_PROMETHEUS_IMAGE": IMAGES["prometheus"],
        "KAFILA_ALERTMANAGER_IMAGE": IMAGES["alertmanager"],
        "KAFILA_PROMETHEUS_PORT": str(ports["prometheus"]),
        "KAFILA_ALERTMANAGER_PORT": str(ports["alertmanager"]),
    }
    compose = [*compose_cmd("kafila-monitoring-test"), "--profile", "monitoring"]
    run(*compose, "up", "-d", "--build", "prometheus", "alertmanager", env=env, timeout=900)
    try:
        yield f"http://127.0.0.1:{ports['prometheus']}", f"http://127.0.0.1:{ports['alertmanager']}"
    finally:
        run(*compose, "down", "-v", env=env, timeout=300)


def answered(url: str, within: float = 90) -> httpx.Response:
    deadline = time.monotonic() + within
    while True:
        try:
            r = httpx.get(url, timeout=5)
            if r.status_code == 200:
                return r
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer 200 within {within:g} s"
        time.sleep(0.5)


def test_prometheus_runs_the_rules_and_sends_to_the_alertmanager_service(monitoring: tuple[str, str]) -> None:
    prometheus, alertmanager = monitoring
    answered(f"{prometheus}/-/ready")
    status = answered(f"{alertmanager}/api/v2/status").json()
    assert status["cluster"]["status"] == "disabled"  # one Alertmanager, no gossip
    assert "receiver: operators" in status["config"]["original"]  # the repository's file
    deadline = time.monotonic() + 60
    while True:  # Prometheus resolves the service name once its notifier starts
        ams = answered(f"{prometheus}/api/v1/alertmanagers").json()["data"]["activeAlertmanagers"]
        if ams:
            break
        assert time.monotonic() < deadline, "Prometheus found no Alertmanager within 60 s"
        time.sleep(1)
    assert [a["url"] for a in ams] == ["http://alertmanager:9093/api/v2/alerts"]
    groups = answered(f"{prometheus}/api/v1/rules").json()["data"]["groups"]
    rules = yaml.safe_load(RULES.read_text())["groups"]
    assert sum(len(g["rules"]) for g in groups) == sum(len(g["rules"]) for g in rules), json.dumps(groups)[
        :500
    ]


def test_the_images_hold_debians_builds_and_run_unprivileged(monitoring: tuple[str, str]) -> None:
    for name, image in IMAGES.items():
        user = run("docker", "image", "inspect", "--format", "{{.Config.User}}", image).strip()
        assert user == "nobody", f"{name}: runs as {user!r}"
        binary = "prometheus" if name == "prometheus" else "prometheus-alertmanager"
        version = run("docker", "run", "--rm", "--entrypoint", f"/usr/bin/{binary}", image, "--version")
        assert "version" in version.lower(), version
