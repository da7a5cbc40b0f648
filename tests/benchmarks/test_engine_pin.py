"""benchmarks/engine.py --threads N: every compared system on the same N CPUs with N threads. Run as
the script runs (its own process), since pinning changes the whole process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
import engine
cpus = engine.pin(1)
from kafila.engine.backend import resolve
resolve("torch", "fp32")  # what a stage's load does: size torch's pool and the kernels'
import torch
from kafila.engine.system import usable_cpus
print(json.dumps({"cpus": cpus, "affinity": sorted(os.sched_getaffinity(0)), "torch": torch.get_num_threads(),
                  "usable": usable_cpus(), "numba_env": os.environ.get("NUMBA_NUM_THREADS")}))
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", code, str(ROOT / "benchmarks")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin to one")
def test_one_thread_pins_the_process_and_kafilas_pools_to_its_first_cpu() -> None:
    done = _run(CHILD)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    first = min(os.sched_getaffinity(0))
    assert got == {"cpus": [first], "affinity": [first], "torch": 1, "usable": 1, "numba_env": "1"}


def test_more_threads_than_cpus_is_refused_naming_the_cpus() -> None:
    n = len(os.sched_getaffinity(0))
    done = _run(f"import sys; sys.path.insert(0, sys.argv[1]); import engine; engine.pin({n + 1})")
    assert done.returncode != 0
    assert f"--threads {n + 1}: this process may use {n} CPUs" in done.stderr


def test_a_gguf_file_is_served_as_its_own_format_and_timed_without_llama_cpp_where_it_is_missing(
    tmp_path: Path,
) -> None:
    """--gguf FILE: Kafila serves the file as `--model FILE` does (the default model's Q4_1 GGUF:
    packed q4) and says llama.cpp was not run when its llama-bench is missing."""
    from kafila.models.default import DEFAULT_MODELS, locate_gguf

    file = locate_gguf(DEFAULT_MODELS["smollm2-135m"])
    argv = [sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--threads", "1", "--gguf", str(file)]
    argv += ["--repeats", "1", "--new-tokens", "4", "--prompt-tokens", "8"]
    argv += ["--llama-bench", str(tmp_path / "none" / "llama-bench")]
    env = os.environ | {"KAFILA_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"[{file.name}: served as q4 weights, fp32 compute]" in done.stdout, done.stdout
    assert "llama.cpp: not run" in done.stdout and "pinned to CPUs" in done.stdout
