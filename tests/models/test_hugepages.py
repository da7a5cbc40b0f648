"""Weight matrices on transparent huge pages: the THP setting, the slabs, the model's bits."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kafila.models.torch import hugepages


def test_the_thp_mode_is_the_bracketed_word_of_the_setting(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    for text, mode in [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
    ]:
        setting.write_text(text)
        assert hugepages.thp_mode(setting) == mode
    assert hugepages.thp_mode(tmp_path / "absent") is None  # macOS, or a kernel without THP
    assert not hugepages.usable("never") and not hugepages.usable(None)


def test_matrices_are_packed_into_slabs_on_cache_lines() -> None:
    """Tensors share a slab, each on a 64-byte boundary, without overlapping; one larger than a
    slab gets its own; one under SMALLEST bytes stays a plain tensor. They outlive the allocator."""
    pages = hugepages.HugePages(slab_bytes=1 << 20)
    got = [pages.empty(s, torch.float32) for s in [(300, 101), (50, 333)]]  # 121.2, 66.6 KB
    got.append(pages.empty((9, 5), torch.bfloat16))
    big = pages.empty((1000, 600), torch.float32)  # 2.4 MB: a slab of its own
    a, b, small = got
    assert a.data_ptr() % hugepages.ALIGN == 0 and b.data_ptr() % hugepages.ALIGN == 0
    assert b.data_ptr() >= a.data_ptr() + a.numel() * 4  # packed after it, in the same slab
    assert b.data_ptr() - a.data_ptr() < (1 << 20)
    assert big.data_ptr() % hugepages.HUGE_PAGE == 0  # a fresh slab starts on a huge page
    assert small.shape == (9, 5) and small.dtype == torch.bfloat16
    assert pages.bytes_placed == (300 * 101 + 50 * 333 + 1000 * 600) * 4  # not the small one
    values = [torch.randn(t.shape) for t in (a, b, big)]
    for t, v in zip((a, b, big), values, strict=True):
        t.copy_(v)
    del pages
    for t, v in zip((a, b, big), values, strict=True):
        assert torch.equal(t, v)


def _huge_kb(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping that holds `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m.group(1), 16) <= address < int(m.group(2), 16):
            for field in lines[i + 1 :]:
                if field.startswith("AnonHugePages:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not hugepages.usable(hugepages.thp_mode()), reason="this system offers no THP")
def test_a_slab_is_backed_by_huge_pages_where_the_system_offers_them() -> None:
    pages = hugepages.HugePages()
    w = pages.empty((4096, 2048), torch.float32)  # 32 MB
    w.copy_(torch.randn(4096, 2048))  # the first writes fault the pages in
    assert _huge_kb(w.data_ptr()) >= 2048


@pytest.mark.parametrize("shape", ["llama-gqa3-tied", "qwen3-gqa2-untied"])
def test_a_model_on_huge_pages_computes_the_same_bits(tiny_checkpoint, monkeypatch, shape: str) -> None:
    """With every matrix placed by HugePages (SMALLEST lowered, as the tiny model's are small) and
    with none, a whole-model stage gives the same logits bit for bit, prefill and decode."""
    from kafila.engine.backend import TorchBackend
    from kafila.engine.stage import Stage
    from kafila.models.checkpoint import Checkpoint
    from tests.models.reference import PROMPT, engine_logits

    ckpt = Checkpoint.open(tiny_checkpoint(shape))

    def logits() -> tuple[np.ndarray, int]:
        cpu = TorchBackend("torch", "cpu", "fp32")  # huge pages are the CPU's, also beside a CUDA card
        stage = Stage.load(ckpt, range(ckpt.n_blocks), True, backend=cpu, dtype="fp32", context=64)
        pages = stage.model._pages
        return engine_logits(stage, PROMPT, prefill=9), 0 if pages is None else pages.bytes_placed

    monkeypatch.setattr(hugepages, "SMALLEST", 0)
    monkeypatch.setattr(hugepages, "for_device", lambda device: hugepages.HugePages())
    placed, n = logits()
    monkeypatch.setattr(hugepages, "for_device", lambda device: None)
    plain, none = logits()
    assert n > 0 and none == 0
    assert np.array_equal(placed, plain)
