"""`kafila run` refuses a model its memory budget cannot hold before it reads a weight, naming the
planner's numbers and the limit that binds (a real cgroup memory limit, not a fake tree)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kafila.engine import system
from kafila.models.checkpoint import Checkpoint
from kafila.planner.cost import Workload, fmt_bytes, shortfall

MEMORY_V1 = Path("/sys/fs/cgroup/memory")
MB = 1_000_000


def _own_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory folder where a child can be made (root), else None."""
    if os.geteuid() != 0 or not MEMORY_V1.is_dir():
        return None
    rel = next(
        (
            line.split(":", 2)[2]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if ":memory:" in line
        ),
        None,
    )
    folder = MEMORY_V1 / rel.lstrip("/") if rel is not None else None
    return folder if folder is not None and os.access(folder, os.W_OK) else None


needs_memory_cgroup = pytest.mark.skipif(
    _own_memory_cgroup() is None, reason="needs root and a writable cgroup v1 memory controller"
)


def _run_capped(limit_bytes: int, *argv: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """`python -m kafila run ARGV` inside a new memory cgroup limited to `limit_bytes`; the result
    and the cgroup's peak usage."""
    parent = _own_memory_cgroup()
    assert parent is not None
    group = parent / f"kafila-test-run-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        cmd = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group)]
        cmd += [sys.executable, "-m", "kafila", "run", "--threads", "1", *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return proc, int((group / "memory.max_usage_in_bytes").read_text())
    finally:
        group.rmdir()


@needs_memory_cgroup
def test_a_model_over_the_cgroup_limit_is_refused_with_the_planner_numbers_and_one_that_fits_answers(
    smollm2_path,
):
    ckpt = Checkpoint.open(smollm2_path)
    need = Workload.of(ckpt.manifest("F32", "none"), 2048, 1).resident_bytes(ckpt.n_blocks, head=True)
    question = "What is the capital of France?"

    refused, peak = _run_capped(400 * MB, "--max-tokens", "4", question)
    assert refused.returncode == 2, refused.stderr[-2000:]  # not 137: refused, not killed
    err = refused.stderr
    assert f"smollm2-135m does not fit: this machine: 30 blocks + head need {fmt_bytes(need)}" in err
    assert "(context 2048 x concurrency 1)" in err
    assert "memory.limit_in_bytes: limit 0.40 GB" in err, err
    assert "stage_loaded" not in err  # no weight read
    assert peak < 400 * MB

    answered, _ = _run_capped(1200 * MB, "--max-tokens", "8", question)
    assert answered.returncode == 0, answered.stderr[-2000:]
    assert "Paris" in answered.stdout


def test_the_tightest_cgroup_limit_on_the_way_to_the_root_binds(monkeypatch, tmp_path):
    """A parent's limit binds its children: a member put in a child group of a capped container."""
    monkeypatch.setattr(system, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(system, "_cgroup_paths", lambda: {"": "/box/member"})
    files = {
        "box/memory.max": "2000000000\n",
        "box/memory.current": "500000000\n",
        "box/member/memory.max": "max\n",
        "box/member/memory.current": "400000000\n",
        "memory.current": "9000000000\n",  # the root has no memory.max
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert system.cgroup_memory_bound() == (
        1_500_000_000,
        f"cgroup v2 {tmp_path / 'box/memory.max'}: limit 2.00 GB, 0.50 GB in use",
    )
    monkeypatch.setattr(system, "meminfo_available", lambda: 8_000_000_000)
    budget = system.memory_budget()
    assert budget is not None and budget.available == 1_500_000_000 and "box/memory.max" in budget.source
    assert budget.usable == 1_500_000_000 - budget.kept
    monkeypatch.setattr(system, "meminfo_available", lambda: 1_000_000_000)
    budget = system.memory_budget()
    assert budget == system.MemoryBudget(1_000_000_000, "MemAvailable in /proc/meminfo")


def test_a_shortfall_names_the_blocks_the_bytes_and_the_budget():
    w = Workload(
        n_blocks=14, block_read_bytes=1e9, block_resident_bytes=1_080_000_000, head_read_bytes=0,
        head_resident_bytes=0, params_per_block=5e8, context=2048, concurrency=1, kv_position_bytes=0,
    )  # fmt: skip
    assert shortfall("laptop-2", 12_000_000_000, w, 14, head=False) == (
        "laptop-2: 14 blocks need 15.1 GB, has 12.0 GB (context 2048 x concurrency 1)"
    )
    assert shortfall("laptop-2", 16_000_000_000, w, 14, head=False) is None
