"""The torch CUDA path: a member with an NVIDIA card, and a ring that mixes it with CPU members.

These need a CUDA device and are skipped without one (CI has none). They run on the project's
device machine (an H200), with the rest of the engine, model and probe tests, which pick the card
by themselves there (`resolve` prefers CUDA): docs/engine.md, "CUDA".
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kafila.engine.backend import TorchBackend, resolve
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from kafila.probe.measure import probe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [5, 9, 1, 77, 120, 3, 64, 18, 250, 31, 8]
CPU32 = TorchBackend("torch", "cpu", "fp32")
CUDA32 = TorchBackend("torch", "cuda", "fp32")


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))


def _load(ckpt: Checkpoint, blocks: range, head: bool, backend: TorchBackend) -> Stage:
    return Stage.load(ckpt, blocks, head, backend=backend, dtype=backend.dtype, context=32)


def _around(stages: list[Stage], h: torch.Tensor, pos: int) -> torch.Tensor:
    """One step around the chain (the first is the head), hidden states crossing every stage as
    wire bytes, as a ring link carries them; the last row back on the head's device."""
    sender = stages[0]
    for s in stages:
        h = s.from_bytes(sender.to_bytes(h), tuple(h.shape))  # [T, H] on s's device
        [h] = s.forward([("r", pos, h)])
        sender = s
    return stages[0].from_bytes(sender.to_bytes(h[-1:]), (1, h.shape[-1]))[0]  # [H]


def _greedy(stages: list[Stage], steps: int = 8) -> tuple[list[int], list[np.ndarray]]:
    """Prefill PROMPT, then greedy decode through the chain: the tokens and every step's logits."""
    head = stages[0]
    for s in stages:
        s.open("r")
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    ids, pos = PROMPT, 0
    for _ in range(steps):
        logits.append(head.logits(_around(stages, head.embed(ids), pos)))  # [V]
        tokens.append(int(logits[-1].argmax()))
        pos, ids = pos + len(ids), [tokens[-1]]
    for s in stages:
        s.close("r")
    return tokens, logits


def test_auto_backend_is_the_card_in_bf16_and_a_stage_keeps_its_weights_there(ckpt: Checkpoint) -> None:
    be = resolve("auto", "auto")
    assert (be.device, be.dtype) == ("cuda", "bf16")
    before = torch.cuda.memory_allocated()
    stage = _load(ckpt, range(5), True, CUDA32)
    assert torch.cuda.memory_allocated() - before >= stage.bytes_loaded > 0
    h = stage.embed(PROMPT)
    assert h.device.type == "cuda" and h.dtype == torch.float32  # [11, 96]


def test_a_cuda_stage_gives_the_cpu_stages_tokens_and_logits(ckpt: Checkpoint) -> None:
    cpu_tokens, cpu_logits = _greedy([_load(ckpt, range(5), True, CPU32)])
    gpu_tokens, gpu_logits = _greedy([_load(ckpt, range(5), True, CUDA32)])
    assert gpu_tokens == cpu_tokens
    for ours, want in zip(gpu_logits, cpu_logits, strict=True):
        np.testing.assert_allclose(ours, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("head_on", ["cpu", "cuda"])
def test_a_ring_of_cpu_and_cuda_members_gives_the_single_cpu_tokens(ckpt: Checkpoint, head_on: str) -> None:
    """A laptop and a desktop with a card in one ring: hidden states leave one device as fp32 wire
    bytes and arrive on the other."""
    want, want_logits = _greedy([_load(ckpt, range(5), True, CPU32)])
    first, other = (CPU32, CUDA32) if head_on == "cpu" else (CUDA32, CPU32)
    ring = [_load(ckpt, range(0, 2), True, first), _load(ckpt, range(2, 4), False, other)]
    ring.append(_load(ckpt, range(4, 5), False, first))
    got, got_logits = _greedy(ring)
    assert got == want
    for ours, ref in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)


def test_bf16_members_on_the_card_and_the_cpu_agree_on_the_wire(ckpt: Checkpoint) -> None:
    """Every member of a session computes and sends in one dtype (`checkpoint_dtype`): a bf16 CPU
    stage feeding a bf16 CUDA stage stays as close to the fp32 model as a bf16 CUDA model alone."""
    cpu16, cuda16 = TorchBackend("torch", "cpu", "bf16"), TorchBackend("torch", "cuda", "bf16")
    ring = [_load(ckpt, range(0, 3), True, cpu16), _load(ckpt, range(3, 5), False, cuda16)]
    assert ring[0].wire_dtype == ring[1].wire_dtype == "BF16"
    mixed, mixed_logits = _greedy(ring, steps=1)  # the prompt's logits: every chain has one input
    alone, alone_logits = _greedy([_load(ckpt, range(5), True, cuda16)], steps=1)
    fp32, fp32_logits = _greedy([_load(ckpt, range(5), True, CPU32)], steps=1)
    err_mixed = float(np.abs(mixed_logits[0] - fp32_logits[0]).max())
    err_alone = float(np.abs(alone_logits[0] - fp32_logits[0]).max())
    print(f"bf16 logits off fp32 by at most: cpu+cuda ring {err_mixed:.4f}, cuda alone {err_alone:.4f}")
    assert mixed == alone == fp32
    assert err_mixed < 2 * err_alone + 0.02, (err_mixed, err_alone)


def test_the_probe_on_the_card_reads_its_free_memory_and_a_bandwidth_no_cpu_reaches() -> None:
    from tests.probe.test_measure import TINY_QWEN3

    free, _total = torch.cuda.mem_get_info()
    r = probe("torch", "auto", repeats=2, model=TINY_QWEN3, model_name="tiny-qwen3")
    assert r.backend == "torch/cuda/bf16"
    assert 0.5 * free <= r.memory_bytes <= 1.01 * free, (r.memory_bytes, free)
    assert r.bandwidth.median > 500e9, r.bandwidth  # HBM: an H200 streams about 4 TB/s
    assert r.block is not None and r.block.median < 0.05
    dev = r.device_report("card")
    assert dev.memory_bytes == r.memory_bytes
    assert dev.bandwidth_bytes_s is not None and dev.bandwidth_bytes_s > 500e9


# -- captured decode steps (kafila.engine.captured): "auto" on the card is "graph" ---------------


def test_graph_decode_on_the_card_gives_the_cards_eager_and_the_cpus_tokens(ckpt: Checkpoint) -> None:
    """Two card stages replaying one CUDA graph each per decode step, hidden states crossing as
    wire bytes, against the card's eager path and the CPU's, fp32: logits within 1e-4."""
    want, want_logits = _greedy([_load(ckpt, range(5), True, CPU32)])
    eager, eager_logits = _greedy([Stage.load(ckpt, range(5), True, CUDA32, "fp32", 32, decode="eager")])
    ring = [_load(ckpt, range(0, 3), True, CUDA32), _load(ckpt, range(3, 5), False, CUDA32)]
    assert [s.decode.name for s in ring] == ["graph", "graph"]
    got, got_logits = _greedy(ring)
    assert got == eager == want
    for ours, ref, card in zip(got_logits, want_logits, eager_logits, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)
        np.testing.assert_allclose(ours, card, rtol=0, atol=1e-4)
    decoder = ring[1].decode.decoder  # type: ignore[attr-defined]
    assert decoder.recorded == [(1, 32)] and len(decoder.capture.graphs) == 1


def test_graph_decode_in_bf16_stays_as_close_to_fp32_as_the_cards_eager(ckpt: Checkpoint) -> None:
    from tests.engine.test_captured import _forced

    cuda16 = TorchBackend("torch", "cuda", "bf16")
    tokens, _ = _greedy([_load(ckpt, range(5), True, CPU32)])
    fp32 = _forced([_load(ckpt, range(5), True, CPU32)], tokens[:-1])
    eager = _forced([Stage.load(ckpt, range(5), True, cuda16, "bf16", 32, decode="eager")], tokens[:-1])
    graph = _forced(
        [_load(ckpt, range(0, 2), True, cuda16), _load(ckpt, range(2, 5), False, cuda16)], tokens[:-1]
    )
    err_eager = max(float(np.abs(a - b).max()) for a, b in zip(eager, fp32, strict=True))
    err_graph = max(float(np.abs(a - b).max()) for a, b in zip(graph, fp32, strict=True))
    print(f"bf16 logits off fp32 by at most: card graph {err_graph:.4f}, card eager {err_eager:.4f}")
    assert [int(x.argmax()) for x in graph] == [int(x.argmax()) for x in eager]
    assert err_graph < 2 * err_eager + 0.02, (err_graph, err_eager)


def test_graph_buckets_on_the_card_share_one_pool_and_pad_without_touching_slots(ckpt: Checkpoint) -> None:
    """Three requests decode in one step (bucket 4), then one alone (bucket 1): two graphs in one
    pool, each row as the card's eager path computes it, the free slots untouched."""
    stages = [Stage.load(ckpt, range(5), True, CUDA32, "fp32", 32, 5, decode=m) for m in ("eager", "graph")]
    prompts = {"a": PROMPT[:3], "b": PROMPT[:7], "c": PROMPT}
    outs = []
    for stage in stages:
        for rid, ids in prompts.items():
            stage.open(rid)
            stage.forward([(rid, 0, stage.embed(ids))])
        three = stage.forward([(rid, len(ids), stage.embed([ids[-1]])) for rid, ids in prompts.items()])
        [one] = stage.forward([("a", 4, stage.embed([1]))])
        outs.append([*three, one])
    for ours, ref in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    decoder = stages[1].decode.decoder  # type: ignore[attr-defined]
    assert decoder.recorded == [(1, 32), (4, 32)] and len(decoder.capture.graphs) == 2
    for k in stages[1].cache.k + stages[1].cache.v:
        assert not k[3:].any()


def test_a_capture_that_syncs_with_the_host_raises_and_the_card_captures_after_it() -> None:
    from kafila.models.torch.static_decode import CudaGraphCapture

    capture = CudaGraphCapture(torch.device("cuda"))
    x = torch.ones(4, device="cuda")

    def syncs() -> None:
        x.add_(float(x.sum().item()))  # .item() waits for the card: not capturable

    def doubles() -> None:
        x.mul_(2.0)

    with pytest.raises(RuntimeError):
        capture(syncs)
    x.fill_(1.0)
    replay = capture(doubles)  # warm-up twice (x = 4), recorded (not run), then replayed once
    replay()
    torch.cuda.synchronize()
    assert x.tolist() == [8.0] * 4


def test_the_probe_on_the_card_times_the_captured_step() -> None:
    from structlog.testing import capture_logs

    from tests.probe.test_measure import TINY_QWEN3

    with capture_logs() as logs:
        r = probe("torch", "auto", repeats=1, model=TINY_QWEN3, model_name="tiny-qwen3")
    [probed] = [e for e in logs if e["event"] == "probed"]
    assert probed["decode"] == "graph" and r.block is not None
    assert not [e for e in logs if e["event"] == "decode_capture_failed"]  # graphs timed, not eager


def test_a_q4_stage_on_the_card_multiplies_with_torchs_int4_matmul_and_matches_the_cpu(
    ckpt: Checkpoint, tmp_path
) -> None:
    """q4 on the card: every q4 product through `_weight_int4pack_mm` (bfloat16 inputs, as its
    kernel takes them), the tokens of the CPU's q4 stage and logits within bf16's rounding of
    them (2% of the largest |logit|)."""
    from kafila.models.quantize import quantize_folder
    from kafila.models.torch.packed import PackedLinear

    packed = Checkpoint.open(quantize_folder(ckpt.path, "q4", tmp_path / "q4", progress=False))

    def stage(backend: TorchBackend) -> Stage:
        return Stage.load(
            packed, range(packed.n_blocks), True, backend=backend, dtype=backend.dtype, context=32
        )

    card = stage(CUDA32)
    want_tokens, want = _greedy([stage(CPU32)])
    tokens, got = _greedy([card])
    q4 = [m for b in card.model.blocks for m in (b.wqkv, b.wo, b.w_gate_up, b.w_down)]
    assert all(isinstance(m, PackedLinear) and m._int4 is not None and m._int4[0] == "cuda" for m in q4)
    assert tokens == want_tokens
    for ours, ref in zip(got, want, strict=True):
        np.testing.assert_allclose(ours, ref, rtol=0, atol=0.02 * np.abs(ref).max())
