"""The rendezvous must run without the inference stack: importing it pulls in no torch or MLX."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import kafila.cli.rendezvous, kafila.rendezvous.server, kafila.net.signaling
from kafila.cli import build_parser
build_parser("rendezvous")
banned = {"torch", "mlx", "numpy", "transformers", "safetensors"}
heavy = sorted(m for m in sys.modules if m.split(".")[0] in banned)
print(",".join(heavy))
"""


def test_rendezvous_imports_no_torch_or_mlx() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"rendezvous imports the inference stack: {out.stdout.strip()}"
