"""The `natlab` fixture: a fresh NAT lab per test module, removed afterwards (also on failure)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.natlab.lab import Lab, missing_requirements


@pytest.fixture(scope="module")
def natlab() -> Iterator[Lab]:
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    with Lab() as lab:
        yield lab
