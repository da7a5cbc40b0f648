"""`kafila run` refuses a model its memory budget cannot hold before it reads a weight, naming the
planner's numbers and the limit that binds (a real cgroup memory limit, not a fake tree)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kafila.demo import memory_groups
from kafila.engine import system
from kafila.models.checkpoint import Checkpoint
from kafila.planner.cost import Workload, fmt_bytes, shortfall

MB = 1_000_000


pytestmark = pytest.mark.root  # a real memory cgroup per run
needs_memory_cgroup = pytest.mark.skipif(
    memory_groups.unavailable() is not None, reason=f"memory groups: {memory_groups.unavailable()}"
)


def _run_capped(limit_bytes: int, *argv: str) -> tuple[subprocess.CompletedProcess[str], int]:
    """`python -m kafila run ARGV` inside a new memory cgroup limited to `limit_bytes`; the result
    and the cgroup's peak usage."""
    group = memory_groups.make_group(limit_bytes, "test-run")
    try:
        cmd = memory_groups.inside(group, [sys.executable, "-m", "kafila", "run", "--threads", "1", *argv])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return proc, memory_groups.peak_bytes(group)
    finally:
        memory_groups.remove_group(group)


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
