"""The planner is a pure package: importing it pulls in no array library, event loop or socket."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "numpy", "mlx", "asyncio", "socket", "structlog")


def test_planner_imports_nothing_heavier_than_the_standard_library():
    code = (
        "import sys\n"
        "import kafila.planner, kafila.planner.fleet, kafila.models.presets\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
