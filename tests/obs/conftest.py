"""A real session for the observability tests that need one (dashboards against Prometheus, the
member page in a browser): a rendezvous and three members on loopback, started once per test run."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class LiveSession:
    rendezvous: str  # HOST:PORT of its signaling port (which serves /metrics)
    members: dict[str, str]  # name -> HOST:PORT of its API (which serves /metrics and the page)
    head: str
    workdir: Path

    def url(self, name: str) -> str:
        return f"http://{self.members[name]}"


@pytest.fixture(scope="session")
def live_session(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[LiveSession]:
    from kafila.session.localfleet import LocalFleet  # the one import of the harness (it may move)

    workdir = tmp_path_factory.mktemp("live-session")
    with LocalFleet([None, None, None], context=256, workdir=workdir, wait_s=240) as fleet:
        assert fleet.rendezvous_url is not None
        rendezvous = fleet.rendezvous_url.split("://", 1)[1].split("/", 1)[0]
        members = {name: url.split("://", 1)[1] for name, url in fleet.api_urls.items()}
        yield LiveSession(rendezvous, members, fleet.head, workdir)
