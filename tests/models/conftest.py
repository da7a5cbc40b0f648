"""Fixtures of the model tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A model cache of the module's own (conversions land there, not in the user's)."""
    folder = tmp_path_factory.mktemp("kafila-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KAFILA_CACHE", str(folder))
        yield folder
