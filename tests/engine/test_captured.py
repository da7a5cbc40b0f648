"""Decode paths (kafila.engine.captured): the static-buffer decode step that a card captures as
CUDA graphs, run here without capture ("static"), against the eager path; buckets, padding rows,
and the fallbacks to eager. The capture itself needs a card: tests/engine/test_cuda.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from kafila.engine.backend import TorchBackend
from kafila.engine.captured import DECODE_ENV, EagerDecode, StaticDecode, decode_path, resolve_mode
from kafila.engine.stage import Entry, Stage
from kafila.models.checkpoint import Checkpoint
from kafila.models.span import Span
from kafila.models.torch.static_decode import (
    BUCKETS,
    StaticDecoder,
    Step,
    keys_bucket,
    rows_bucket,
)
from tests.engine.test_cuda import PROMPT, _greedy

CPU32 = TorchBackend("torch", "cpu", "fp32")
CPU16 = TorchBackend("torch", "cpu", "bf16")
SPLITS = {1: [(0, 5)], 2: [(0, 3), (3, 5)]}
# fp32 logits of the static step (torch's ops) against eager (on the CPU the compiled kernel, which
# sums in another order): test_cuda.py's bound; seen up to 2.5e-5 on logits of magnitude 3
FP32_ATOL = 1e-4
U32 = 2.0**-24  # float32's unit roundoff


def order_bound(length: int, magnitude: float) -> float:
    """How far two float32 sums of the same `length` terms, added in different orders, can be apart
    when the terms' magnitudes add up to `magnitude`: each is within gamma_n magnitude of the exact
    sum (gamma_n = n u / (1 - n u), Higham, "Accuracy and Stability of Numerical Algorithms" 3.1),
    so the two within twice that. A block's outputs are such sums (the longest: the MLP's down
    product over the intermediate width), each within a small factor of the row's largest value."""
    gamma = length * U32 / (1 - length * U32)
    return 2 * gamma * magnitude


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("qwen3-gqa4-tied"))


def _stages(ckpt: Checkpoint, split: int, decode: str, be: TorchBackend = CPU32, **kw) -> list[Stage]:
    kw.setdefault("context", 32)
    return [
        Stage.load(ckpt, range(a, b), a == 0, backend=be, dtype=be.dtype, decode=decode, **kw)
        for a, b in SPLITS[split]
    ]


def test_buckets_of_rows_and_keys() -> None:
    assert [rows_bucket(n) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert rows_bucket(65) is None
    assert [keys_bucket(n, 2048) for n in (1, 64, 65, 257, 2048)] == [64, 64, 128, 512, 2048]
    assert keys_bucket(300, 257) == 257  # never past the context


@pytest.mark.parametrize(
    ("shape", "split"), [("qwen3-gqa4-tied", 1), ("qwen3-gqa4-tied", 2), ("llama-mqa-headdim", 2)]
)
def test_static_steps_give_the_eager_tokens_and_logits_in_fp32(
    tiny_checkpoint, shape: str, split: int
) -> None:
    """One stage, and two passing hidden states as wire bytes: the static step (torch's ops over a
    masked window of the cache) against the eager path (the compiled CPU kernel) for 8 tokens; a
    Qwen3 (norms on q and k) and a Llama of one KV head of width 24 (not hidden / heads)."""
    ckpt = Checkpoint.open(tiny_checkpoint(shape))
    want, want_logits = _greedy(_stages(ckpt, 1, "eager"))
    stages = _stages(ckpt, split, "static")
    assert all(s.decode.name == "static" for s in stages)
    got, got_logits = _greedy(stages)
    assert got == want
    for ours, ref in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=0, atol=FP32_ATOL)
    assert stages[0].decode.decoder.recorded == [(1, 32)]  # type: ignore[attr-defined]


def test_static_steps_over_a_window_shorter_than_the_context(ckpt: Checkpoint) -> None:
    """A 70-token prompt in a 160-token context: decode steps attend over 128 keys (positions
    70..77), masked on the device; the same logits as eager."""
    prompt = [(7 * i + 3) % 250 for i in range(70)]

    def run(decode: str) -> tuple[list[int], list[np.ndarray], Stage]:
        [stage] = _stages(ckpt, 1, decode, context=160)
        stage.open("r")
        tokens, logits, ids, pos = [], [], prompt, 0
        for _ in range(8):
            [h] = stage.forward([("r", pos, stage.embed(ids))])
            logits.append(stage.logits(h[-1]))
            tokens.append(int(logits[-1].argmax()))
            pos, ids = pos + len(ids), [tokens[-1]]
        return tokens, logits, stage

    want, want_logits, _ = run("eager")
    got, got_logits, stage = run("static")
    assert got == want and stage.decode.decoder.recorded == [(1, 128)]  # type: ignore[attr-defined]
    for ours, ref in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=0, atol=FP32_ATOL)


def _forced(stages: list[Stage], tokens: list[int]) -> list[np.ndarray]:
    """The logits of PROMPT, then of each of `tokens` fed in turn (every chain sees one input)."""
    head = stages[0]
    for s in stages:
        s.open("r")
    logits, ids, pos = [], PROMPT, 0
    for token in [None, *tokens]:
        ids = ids if token is None else [token]
        h = head.embed(ids)
        for s in stages:
            [h] = s.forward([("r", pos, s.from_bytes(head.to_bytes(h), tuple(h.shape)))])
        logits.append(head.logits(h[-1]))
        pos += len(ids)
    return logits


def test_static_steps_in_bf16_stay_as_close_to_fp32_as_eager(ckpt: Checkpoint) -> None:
    """bf16 against fp32, every path fed fp32's greedy tokens (a free-running bf16 run leaves fp32's
    tokens where two logits are closer than bf16 resolves: 0.03 apart at the fifth step here)."""
    tokens, _ = _greedy(_stages(ckpt, 1, "eager"))
    fp32 = _forced(_stages(ckpt, 1, "eager"), tokens[:-1])
    eager = _forced(_stages(ckpt, 1, "eager", CPU16), tokens[:-1])
    static = _forced(_stages(ckpt, 2, "static", CPU16), tokens[:-1])
    err_eager = max(float(np.abs(a - b).max()) for a, b in zip(eager, fp32, strict=True))
    err_static = max(float(np.abs(a - b).max()) for a, b in zip(static, fp32, strict=True))
    assert [int(x.argmax()) for x in static] == [int(x.argmax()) for x in eager]
    assert err_static < 2 * err_eager + 0.02, (err_static, err_eager)


def test_three_rows_pad_to_four_and_the_padding_row_touches_no_slot(ckpt: Checkpoint) -> None:
    """Three requests at different positions decode in one step: bucket 4, the fourth row a padding
    row. Each row's output is eager's, the requests' cache entries are eager's, the slots nobody
    holds are still zeros, and the padding row wrote the spare rows (NaN before), which no row read."""
    eager, static = (_stages(ckpt, 1, mode, concurrency=5)[0] for mode in ("eager", "static"))
    prompts = {"a": PROMPT[:3], "b": PROMPT[:7], "c": PROMPT}
    outs = {}
    for stage in (eager, static):
        for rid, ids in prompts.items():
            stage.open(rid)
            stage.forward([(rid, 0, stage.embed(ids))])
        steps = [(rid, len(ids), stage.embed([ids[-1]])) for rid, ids in prompts.items()]
        if stage is static:  # the spare rows: NaN, which a row reading them would carry to its output
            for flat in static.decode.decoder.static.flat_k:  # type: ignore[attr-defined]
                flat[-2:] = float("nan")  # [nkv, d]
        outs[stage.decode.name] = [o.float() for o in stage.forward(steps)]
    assert static.decode.decoder.recorded == [(4, 32)]  # type: ignore[attr-defined]
    longest = max(ckpt.config.hidden_size, ckpt.config.intermediate_size)  # a block's longest product
    for ours, ref in zip(outs["static"], outs["eager"], strict=True):
        torch.testing.assert_close(ours, ref, rtol=0, atol=order_bound(longest, float(ref.abs().max())))
    for k_s, k_e in zip(static.cache.k + static.cache.v, eager.cache.k + eager.cache.v, strict=True):
        bound = order_bound(ckpt.config.hidden_size, float(k_e.abs().max()))  # k, v: products over H
        torch.testing.assert_close(k_s, k_e, rtol=0, atol=bound)
        assert not k_s[3:].any()  # slots 3 and 4 never held a request: untouched
    for flat in static.decode.decoder.static.flat_k:  # type: ignore[attr-defined]
        assert not flat[-2:].isnan().any()  # where the padding row wrote its keys (zeros: a zero row)


def test_a_step_past_the_largest_bucket_runs_eager_and_says_so_once(ckpt: Checkpoint) -> None:
    rows = BUCKETS[-1] + 1
    [stage] = _stages(ckpt, 1, "static", concurrency=rows, context=8)
    [ref] = _stages(ckpt, 1, "eager", concurrency=rows, context=8)
    h = stage.embed(list(range(rows)))  # [65, H]: one row per request, all at position 0, then 1
    with capture_logs() as logs:
        for s in (stage, ref):
            for i in range(rows):
                s.open(i)
            for pos in (0, 1):
                out = s.step(h, [Entry(i, pos, 1) for i in range(rows)])
            if s is stage:
                got = out
    assert [e["event"] for e in logs if e["event"].startswith("decode")] == ["decode_outside_buckets"]
    torch.testing.assert_close(got, out, rtol=0, atol=0)  # the same eager code on the same cache
    assert stage.decode.decoder.recorded == []  # type: ignore[attr-defined]


def _capture_that_raises(step: Step) -> Step:
    """A capture that fails as a card's can (an op that syncs with the host while recording)."""
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_capture_that_raises_turns_the_stage_eager_with_one_event(ckpt: Checkpoint) -> None:
    want, want_logits = _greedy(_stages(ckpt, 1, "eager"))
    [stage] = _stages(ckpt, 1, "eager")
    path = StaticDecode(StaticDecoder(stage.model, 1, _capture_that_raises), "graph", "test")
    stage.decode, stage.cache = path, path.cache
    with capture_logs() as logs:
        got, got_logits = _greedy([stage])
    failed = [e for e in logs if e["event"] == "decode_capture_failed"]
    assert len(failed) == 1 and "1 rows over 32 keys" in failed[0]["error"]
    assert path.name == "eager" and got == want
    for ours, ref in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=0, atol=0)  # eager from the first decode step on


def test_modes_resolve_per_device_and_graphs_on_the_cpu_fall_back(
    ckpt: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda16 = TorchBackend("torch", "cuda", "bf16")
    assert (resolve_mode("auto", CPU32), resolve_mode("auto", cuda16)) == ("eager", "graph")
    monkeypatch.setenv(DECODE_ENV, "static")
    assert resolve_mode("auto", cuda16) == "static" and resolve_mode("eager", cuda16) == "eager"
    monkeypatch.setenv(DECODE_ENV, "fast")
    with pytest.raises(ValueError, match=r"\$KAFILA_DECODE 'fast' is not one of auto, eager, static, graph"):
        resolve_mode("auto", CPU32)
    monkeypatch.delenv(DECODE_ENV)
    [stage] = _stages(ckpt, 1, "eager")
    with capture_logs() as logs:
        path = decode_path(stage.model, CPU32, 1, "graph", "cpu-stage")
        path.forward(stage.embed([1]), [Span(0, 0, 1)])
    assert isinstance(path, EagerDecode)
    assert [(e["event"], e["reason"]) for e in logs] == [("decode_graphs_unavailable", "device cpu")]


def test_the_static_step_runs_on_the_meta_device_so_no_value_reaches_the_host() -> None:
    """A captured step may not read a value on the host (`.item()`, a boolean mask's `nonzero`, a
    shape taken from the data): on the meta device, which holds shapes without values, each of
    those raises. The whole static step, buffers filled as a stage fills them, runs there."""
    from dataclasses import replace

    from kafila.models.manifest import block_index, specs_from_config
    from kafila.models.torch.qwen3 import Qwen3Model
    from tests.probe.test_measure import TINY_QWEN3

    specs = specs_from_config(replace(TINY_QWEN3, num_hidden_layers=2), "F32")
    weights = {s.name: torch.zeros(s.shape) for s in specs if block_index(s.name) is not None}
    model = Qwen3Model(TINY_QWEN3, weights, range(2), False, device="meta", context=64)
    decoder = StaticDecoder(model, slots=3)
    out = decoder.forward(torch.empty(2, TINY_QWEN3.hidden_size), [Span(0, 5, 1), Span(2, 9, 1)])
    assert (out.device.type, tuple(out.shape), decoder.recorded) == ("meta", (2, 256), [(2, 64)])
    with pytest.raises(RuntimeError, match="meta"):
        out.sum().item()  # what a host read in the step would have met


@pytest.mark.slow
def test_the_cuda_decode_benchmark_runs_on_the_cpu_with_a_tiny_config(tmp_path) -> None:
    """benchmarks/cuda_decode.py end to end where no card is: its checkpoint, both paths (static for
    graph), the two-process ring; the figures themselves are the card's to judge."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "benchmarks" / "cuda_decode.py"), "--device", "cpu", "--small"]
    cmd += ["--rounds", "1", "--steps", "2", "--rows", "1", "3", "--ring-tokens", "4"]
    cmd += ["--dir", str(tmp_path / "ckpt"), "--json", str(tmp_path / "out.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads((tmp_path / "out.json").read_text())
    assert [(r["path"], r["rows"]) for r in figures["steps"]] == [
        ("eager", 1),
        ("static", 1),
        ("eager", 3),
        ("static", 3),
    ]
    assert all(r["ms_step"] > 0 and r["of_bound"] > 0 for r in figures["steps"])
    assert figures["ring"]["ratio"] > 0 and "of bound" in done.stdout


def test_the_probes_block_timing_runs_the_path_a_stage_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kafila probe` times a block through `decode_path`, as a stage steps: with the static path
    selected its decode step is the static step (counted as it runs), eager otherwise."""
    from kafila.models.torch import static_decode
    from kafila.probe.ops import Ops
    from tests.probe.test_measure import TINY_QWEN3

    calls: list[int] = []
    real = static_decode.static_step

    def counted(*args: object, **kw: object) -> None:
        calls.append(1)
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(static_decode, "static_step", counted)
    for mode, want in (("eager", 0), ("static", 2)):
        monkeypatch.setenv(DECODE_ENV, mode)
        run = Ops(CPU32).make_block(TINY_QWEN3, position=70, blocks=1)
        run()
        run()
        assert len(calls) == want, mode
