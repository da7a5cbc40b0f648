"""The torch Llama and Qwen3 match transformers in fp32 for every tiny shape."""

from __future__ import annotations

import pytest

from tests.models.reference import check_against_transformers
from tests.tiny_models import SHAPES


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_torch_logits_and_greedy_tokens_match_transformers(tiny_checkpoint, shape: str) -> None:
    check_against_transformers(tiny_checkpoint(shape), "torch")


def test_torch_reads_a_sharded_checkpoint(tiny_checkpoint) -> None:
    check_against_transformers(tiny_checkpoint("qwen3-gqa2-untied", sharded=True), "torch")


def test_unsupported_rope_scaling_is_refused_by_name(tiny_checkpoint) -> None:
    """Refused when the config is read (so `kafila plan` refuses it too), not at stage load."""
    import dataclasses

    from kafila.models.checkpoint import Checkpoint
    from kafila.models.config import ConfigError

    ckpt = Checkpoint.open(tiny_checkpoint("llama-mha-untied"))
    with pytest.raises(ConfigError, match="rope_scaling type 'yarn' is not supported"):
        dataclasses.replace(ckpt.config, rope_scaling={"rope_type": "yarn", "factor": 4.0})
