"""The `natlab` and `wanlab` fixtures: a fresh NAT lab (with WAN edges: `wanlab`) per test module,
removed afterwards (also on failure)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.natlab.lab import Lab, missing_requirements
from tests.natlab.wanlab import WanLab


@pytest.fixture(scope="module")
def natlab() -> Iterator[Lab]:
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    with Lab() as lab:
        yield lab


@pytest.fixture(scope="module")
def wanlab() -> Iterator[WanLab]:
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    with WanLab() as lab:
        yield lab
