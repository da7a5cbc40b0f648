"""The MLX Llama and Qwen3 (mlx[cpu] on Linux) match transformers in fp32 for every tiny shape."""

from __future__ import annotations

import pytest

from tests.models.reference import check_against_transformers
from tests.tiny_models import SHAPES

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'kafila[mlx]')")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_mlx_logits_and_greedy_tokens_match_transformers(tiny_checkpoint, shape: str) -> None:
    check_against_transformers(tiny_checkpoint(shape), "mlx")
