"""What the Ollama routes say of the served model (kafila.api.state.ModelFacts) in each weight format."""

from __future__ import annotations

import pytest

from kafila.api.state import ModelFacts
from kafila.models.checkpoint import Checkpoint
from kafila.models.quantize import quantize_folder


@pytest.mark.parametrize(("fmt", "level"), [("none", "F32"), ("int8", "Q8_0"), ("q4", "Q4_1")])
def test_a_packed_sessions_size_is_its_packed_folders_bytes(tiny_checkpoint, tmp_path, fmt, level) -> None:
    """/api/ps's size and /api/show's quantization_level follow the session's weight format: the
    size is what `kafila models --quantize` writes (it was the float size whatever the format)."""
    src = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))
    folder = src.path if fmt == "none" else quantize_folder(src.path, fmt, tmp_path / fmt, progress=False)
    written = sum(t.nbytes for t in Checkpoint.open(folder).tensors.values())
    facts = ModelFacts.of(src.config, "F32", quant=fmt)
    assert (facts.size_bytes, facts.level) == (written, level)
    assert facts.parameters == ModelFacts.of(src.config, "F32").parameters  # the model's, whatever the bytes
