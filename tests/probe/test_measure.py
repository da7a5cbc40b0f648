"""The probe on this machine: sane figures, quickly, with the real backends and engine model code."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from kafila.cli import main
from kafila.engine.backend import resolve
from kafila.engine.system import usable_cpus
from kafila.models.config import ModelConfig
from kafila.planner import plan
from kafila.planner.devices import DeviceReport
from kafila.probe import measure
from kafila.probe.measure import ProbeReport, probe

TINY_QWEN3 = ModelConfig.from_dict(
    {
        "model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "vocab_size": 512,
    }
)  # fmt: skip


@pytest.fixture(autouse=True)
def short_windows(monkeypatch):
    monkeypatch.setattr(measure, "WINDOW_S", 0.01)
    monkeypatch.setattr(measure, "QUOTA_WINDOW_S", 0.1)


def check_sane(r: ProbeReport) -> None:
    assert 0.1e9 < r.bandwidth.median < 20e12, r.bandwidth
    assert 0.1e9 < r.matvec_bandwidth.median < 20e12, r.matvec_bandwidth
    assert 1e-7 < r.overhead.median < 0.05, r.overhead
    assert 1e7 < r.flops.median < 1e17, r.flops
    assert r.memory_bytes > 1 << 28
    for fig in (r.bandwidth, r.overhead, r.flops):
        assert fig.lo <= fig.median <= fig.hi and fig.n == 2


def test_torch_probe_is_sane_and_quick():
    r = probe("torch", "fp32", repeats=2, model=TINY_QWEN3, model_name="tiny-qwen3")
    check_sane(r)
    # how long the probe takes is printed by `kafila probe` (wall_s), not asserted: a timed unit test
    # fails on a loaded machine (14-25 s here under load, about 2 s quiet)
    device = resolve("torch", "fp32").device  # the CPU here; the card on a machine with CUDA
    assert r.backend == f"torch/{device}/fp32" and r.wall_s > 0
    assert r.block is not None and 1e-6 < r.block.median < 0.5
    assert r.block_dispatch is not None and 1e-6 < r.block_dispatch.median < 0.5
    assert r.head is not None and 1e-6 < r.head.median < 0.5
    assert r.stage_fixed is not None and 0.0 <= r.stage_fixed.median < 0.5
    assert r.device_report("x").stage_fixed_s == r.stage_fixed.median
    assert r.wake is not None and r.wake.n == 2 and r.wake_tau_s is not None
    dev = r.device_report("x")
    assert dev.wake_s == pytest.approx(measure.wake_w(r.wake.median, r.wake_tau_s)) and dev.wake_s >= 0
    assert ProbeReport.from_dict(r.to_dict()) == r
    assert r.threads == (usable_cpus() if device == "cpu" else None)  # what the engine runs with
    assert r.block_bytes == 4 * (256 * (256 + 2 * 128) + 256 * 256 + 3 * 256 * 512 + 2 * 256 + 2 * 64)


def test_block_probe_cycles_stages_whose_weights_outgrow_the_last_level_cache():
    from dataclasses import replace

    import torch

    from kafila.engine.backend import resolve
    from kafila.probe.measure import _cold_stage
    from kafila.probe.ops import Ops

    ops = Ops(resolve("torch", "fp32"))
    deep = replace(TINY_QWEN3, num_hidden_layers=32)  # 32 blocks of 2.4 MB: more than twice 10 MiB
    run, copies = _cold_stage(ops, deep, 8, 3, llc=10 * 2**20)
    nbytes = ops.block_bytes(deep)
    assert copies == -(-2 * 10 * 2**20 // (3 * nbytes)) and copies > 1  # distinct 3-block stages
    outs = [run() for _ in range(copies + 1)]  # [1, H] each
    assert tuple(outs[0].shape) == (1, deep.hidden_size)
    assert not torch.equal(outs[0], outs[1])  # the next call, another stage's weights
    assert torch.equal(outs[0], outs[copies])  # after every stage once, the first again
    assert _cold_stage(ops, TINY_QWEN3, 8, 3, llc=0)[1] == 1  # no cache known: one stage


def test_a_small_model_is_cycled_through_no_more_blocks_than_it_has():
    """Its whole weights fit in the cache in a ring too: copies hold the model's blocks, no more;
    a model larger than the cache is cycled through twice the cache as before."""
    from dataclasses import replace

    from kafila.engine.backend import resolve
    from kafila.probe.measure import _cold_stage
    from kafila.probe.ops import Ops

    ops = Ops(resolve("torch", "fp32"))
    six = replace(TINY_QWEN3, num_hidden_layers=6)
    assert _cold_stage(ops, six, 8, 5, llc=300 * 2**20)[1] == 2  # ceil(6 / 5) stages of 5 blocks
    assert _cold_stage(ops, six, 8, 1, llc=300 * 2**20)[1] == 6  # one-block stages: one per block
    assert _cold_stage(ops, six, 8, 10, llc=300 * 2**20)[1] == 1
    small_cache = 5 * ops.block_bytes(six)  # the six blocks do not fit: ten blocks' bytes cycled
    assert _cold_stage(ops, six, 8, 5, llc=small_cache)[1] == 2
    assert _cold_stage(ops, six, 8, 1, llc=small_cache)[1] == 10


def test_the_probes_stage_has_at_most_five_blocks_and_no_more_than_fill_twice_the_cache():
    from kafila.probe.measure import stage_blocks

    mb = 2**20
    assert stage_blocks(300 * mb, 14 * mb) == 5  # a large cache: five blocks, cycled through copies
    assert stage_blocks(32 * mb, 14 * mb) == 5  # ceil(64 / 14)
    assert stage_blocks(16 * mb, 14 * mb) == 3  # three already fill twice the cache
    assert stage_blocks(32 * mb, 800 * mb) == 2  # large blocks: two, as few as the split needs
    assert stage_blocks(0, 14 * mb) == 2  # no cache known


def test_a_stage_timed_at_three_block_counts_splits_into_per_step_and_per_block_parts():
    from kafila.probe.measure import fit_fixed

    # t = 2 ms + blocks x 1 ms
    assert fit_fixed({1: 0.003, 5: 0.007, 10: 0.012}) == pytest.approx((0.002, 0.001))
    # noise on the long stages: the one-block stage keeps the per-step part near its 2 ms, where
    # 2 t(5) - t(10) alone would say 2.6 ms and an unweighted line 2.11 ms
    fixed, per = fit_fixed({1: 0.003, 5: 0.0073, 10: 0.012})
    assert fixed == pytest.approx(0.001994, abs=1e-6) and per == pytest.approx(0.001023, abs=1e-6)
    # a line that would cross below 0: through the origin instead (never a negative per-step part),
    # weighted alike: sum(x y / y^2) / sum(x^2 / y^2)
    # 5% too long a ten-block step (1 ms of 19) barely moves the one-block stage's prediction:
    # each point counts by its relative error (unweighted, the prediction fell 6.9%)
    fixed, per = fit_fixed({1: 0.4 + 1.85, 5: 0.4 + 5 * 1.85, 10: (0.4 + 10 * 1.85) * 1.05})
    assert fixed + per == pytest.approx(2.25, rel=0.005)
    ts = {1: 0.001, 5: 0.0055, 10: 0.011}
    through_origin = sum(x / y for x, y in ts.items()) / sum((x / y) ** 2 for x, y in ts.items())
    assert fit_fixed(ts) == pytest.approx((0.0, through_origin))
    assert fit_fixed({1: 0.006, 5: 0.006, 10: 0.005}) == pytest.approx((0.0, 0.0005))  # not slower: no split
    from kafila.engine.backend import resolve
    from kafila.probe.ops import Ops

    run = Ops(resolve("torch", "fp32")).make_block(TINY_QWEN3, 8, blocks=6)
    assert tuple(run().shape) == (1, TINY_QWEN3.hidden_size)  # one row through the six blocks


def test_a_step_timed_after_three_idle_gaps_fits_a_saturating_wake_up():
    import math

    from kafila.planner.cost import wake_cost_s
    from kafila.probe.measure import WAKE_GAPS_S, WAKE_TAU_S, fit_wake, wake_w

    def t(g: float, w: float, tau: float) -> float:  # t(g) = t0 + W (1 - e^(-g/tau)), t0 = 0.5 ms
        return 0.0005 + w * (1 - math.exp(-g / tau))

    for w, tau in ((0.0003, 0.007), (0.002, 0.02), (0.0001, 0.002)):
        steps = [t(g, w, tau) for g in WAKE_GAPS_S]
        fw, ftau = fit_wake(steps)
        assert (fw, ftau) == (pytest.approx(w, rel=1e-6), pytest.approx(tau, rel=1e-6))
        assert wake_w(steps[-1] - steps[0], ftau) == pytest.approx(w, rel=1e-6)
        # the planner's curve: what a step after g costs over one after the shortest gap
        assert wake_cost_s(fw, ftau, 0.02) == pytest.approx(t(0.02, w, tau) - steps[0])
    assert fit_wake([0.0006, 0.0005, 0.0005])[0] == 0.0  # no slower after a long idle: nothing to add
    # the whole rise already after the middle gap: the smallest tau; a straight line: the largest
    assert fit_wake([0.0005, 0.0007, 0.0007])[1] == pytest.approx(WAKE_TAU_S[0], rel=1e-6)
    assert fit_wake([0.0005, 0.00051, 0.0007])[1] == pytest.approx(WAKE_TAU_S[1], rel=1e-6)


def test_head_probe_unembeds_one_row_of_the_model_vocabulary():
    from kafila.engine.backend import resolve
    from kafila.probe.ops import Ops

    run, nbytes = Ops(resolve("torch", "fp32")).make_head(TINY_QWEN3)
    assert nbytes == 4 * TINY_QWEN3.vocab_size * TINY_QWEN3.hidden_size
    assert tuple(run().shape) == (1, TINY_QWEN3.vocab_size)


def test_head_probe_of_an_untied_model_allocates_one_vocabulary_matrix_not_two():
    """The embedding is not what a decode step's head reads: at Qwen3-8B's widths allocating it
    beside the unembedding doubles the probe's largest allocation (2 x 1.24 GB in bf16)."""
    from dataclasses import replace

    from kafila.engine.backend import resolve
    from kafila.probe.ops import Ops

    untied = replace(TINY_QWEN3, tie_word_embeddings=False)
    ops = Ops(resolve("torch", "bf16"))
    weights = ops.head_weights(untied)
    vh = (untied.vocab_size, untied.hidden_size)
    assert [tuple(w.shape) for w in weights.values()].count(vh) == 1
    assert sum(w.numel() * w.element_size() for w in weights.values()) < 1.01 * 2 * vh[0] * vh[1]
    run, nbytes = ops.make_head(untied)
    assert nbytes == 2 * vh[0] * vh[1]  # the unembedding it reads, in bf16
    assert tuple(run().shape) == (1, untied.vocab_size)


def test_a_packed_sessions_probe_draws_its_matrices_packed_with_no_float_copy():
    """In q4 the unembedding is int8 and the blocks' matrices q4: drawn as such, so the probe's
    largest allocation is the packed matrix, not a float32 one four times its size."""
    from dataclasses import replace

    import torch

    from kafila.engine.backend import resolve
    from kafila.probe.ops import Ops

    untied = replace(TINY_QWEN3, tie_word_embeddings=False)
    ops = Ops(resolve("torch", "fp32"), "q4")
    head = ops.head_weights(untied)
    vh = (untied.vocab_size, untied.hidden_size)
    assert head["model.embed_tokens.weight"].dtype == torch.int8
    assert tuple(head["model.embed_tokens.weight"].shape) == vh
    assert not any(w.dtype == torch.float32 and w.dim() == 2 for w in head.values())
    run, nbytes = ops.make_head(untied)
    assert tuple(run().shape) == (1, untied.vocab_size)
    assert nbytes == vh[0] * vh[1] * 34 // 32  # int8 and a float16 scale per 32
    block = ops.make_block(untied, position=3, blocks=2)
    assert tuple(block().shape) == (1, untied.hidden_size)


def test_stage_shaped_timing_idles_between_calls_as_a_ring_of_three_does():
    from kafila.probe.measure import STEPS, seconds_per_step

    calls: list[float] = []

    def run() -> None:
        calls.append(time.perf_counter())
        time.sleep(0.002)

    out = seconds_per_step(run, repeats=2, idle_ratio=2.0)
    assert len(out) == 2 and len(calls) == 2 + 2 * STEPS
    assert all(0.0015 < s < 0.05 for s in out)
    gaps = [b - a for a, b in itertools.pairwise(calls[1:])]
    assert min(gaps) > 0.002 * 1.9  # the call itself plus at least its length idle (2x, -50%)


def test_an_emulated_pace_stretches_every_probed_call_by_its_cpu_time():
    from kafila.engine.pace import Pace
    from kafila.probe.measure import seconds_per_call, seconds_per_step

    def run() -> None:  # 2 ms of CPU
        end = time.process_time() + 0.002
        while time.process_time() < end:
            pass

    half = Pace(0.5)
    stepped = seconds_per_step(run, repeats=1, idle_ratio=0.5, pace=half)
    looped = seconds_per_call(run, repeats=2, window_s=0.02, pace=half)
    assert 0.0038 < stepped[0] < 0.006
    assert all(0.0038 < s < 0.006 for s in looped)


def test_block_dispatch_runs_the_same_architecture_at_tiny_shapes():
    from kafila.engine.backend import resolve
    from kafila.probe.ops import Ops, tiny_shapes

    tiny = tiny_shapes(TINY_QWEN3)
    assert (tiny.model_type, tiny.qk_norm, tiny.rope_theta) == (
        "qwen3",
        TINY_QWEN3.qk_norm,
        TINY_QWEN3.rope_theta,
    )
    assert tiny.num_attention_heads // tiny.num_key_value_heads == 2  # the model's GQA ratio
    assert tiny.hidden_size < TINY_QWEN3.hidden_size
    run, n = Ops(resolve("torch", "fp32")).make_block_dispatch(TINY_QWEN3, 8)
    assert n == 2
    run()


def test_mlx_probe_is_sane():
    pytest.importorskip("mlx.core")
    r = probe("mlx", "fp32", repeats=2)
    check_sane(r)
    assert r.backend.startswith("mlx/")


def test_report_feeds_the_planner_and_round_trips():
    r = probe("torch", "fp32", repeats=2, model=TINY_QWEN3, model_name="tiny-qwen3")
    assert ProbeReport.from_dict(json.loads(r.to_json())) == r
    dev = r.device_report("here", rtt_s=0.02)
    assert dev.bandwidth_bytes_s == r.bandwidth.median and dev.block_s == r.block.median
    assert dev.block_dispatch_s == r.block_dispatch.median and dev.head_s == r.head.median
    assert DeviceReport.from_json(dev.to_json()) == dev
    from kafila.models.presets import resolve_manifest

    p = plan([dev, r.device_report("twin", use_block=False)], resolve_manifest("smollm2-135m"), context=512)
    assert p.feasible and p.tier == "full"


def test_cli_probe_json(capsys):
    assert (
        main(["probe", "--backend", "torch", "--dtype", "fp32", "--repeats", "2", "--json", "--name", "box"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["device"]["name"] == "box" and out["device"]["bandwidth_bytes_s"] > 0
    assert out["probe"]["overhead"]["n"] == 2
