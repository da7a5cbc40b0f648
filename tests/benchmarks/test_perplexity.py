"""benchmarks/perplexity.py: llama.cpp's perplexity protocol on Kafila's side (the second half of
each chunk counted), checked against torch's cross entropy, and the script on the default GGUF."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports llama_build as it runs
_spec = importlib.util.spec_from_file_location("perplexity_bench", ROOT / "benchmarks" / "perplexity.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_a_chunks_counted_tokens_are_its_second_half_scored_by_the_position_before() -> None:
    rng = np.random.default_rng(3)
    n_ctx, vocab = 16, 50
    logits = rng.normal(0, 4, (n_ctx, vocab)).astype(np.float32)  # [n_ctx, V]
    ids = [int(i) for i in rng.integers(0, vocab, n_ctx)]
    got = bench.chunk_nll(logits, ids, n_ctx // 2)
    assert len(got) == n_ctx - 1 - n_ctx // 2  # llama.cpp's count per chunk
    scored, targets = torch.from_numpy(logits[n_ctx // 2 : -1]).double(), torch.tensor(ids[n_ctx // 2 + 1 :])
    want = torch.nn.functional.cross_entropy(scored, targets, reduction="none")
    assert np.allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


def test_the_script_prints_kafilas_perplexity_of_the_default_gguf_and_says_llama_cpp_was_not_run(
    tmp_path: Path,
) -> None:
    from kafila.models.default import DEFAULT_MODELS, locate_gguf

    file = locate_gguf(DEFAULT_MODELS["smollm2-135m"])
    argv = [sys.executable, str(ROOT / "benchmarks" / "perplexity.py"), "--gguf", str(file)]
    argv += ["--llama-perplexity", str(tmp_path / "none")]
    env = os.environ | {"KAFILA_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if "(each chunk one prefill)" in x)
    ppl = float(line.split("perplexity")[1].split()[0])
    assert math.isfinite(ppl) and 1.0 < ppl < 50.0, done.stdout  # a trained model on English prose
    assert "llama.cpp  not run" in done.stdout
