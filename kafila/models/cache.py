"""Where kafila keeps what it converts and fetches: `$KAFILA_CACHE`, else `$XDG_CACHE_HOME/kafila`,
else `~/.cache/kafila`; models live in `<cache>/models/<name>/`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("KAFILA_CACHE"):
        return Path(os.environ["KAFILA_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kafila"
    return Path.home() / ".cache" / "kafila"


def models_dir() -> Path:
    return cache_dir() / "models"
