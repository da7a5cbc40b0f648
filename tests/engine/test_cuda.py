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
