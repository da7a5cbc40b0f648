"""What name a session serves a model under: the API's model id, the same on every member."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafila.models.registry import ModelNotFound, resolve, served_name


def test_a_model_name_is_served_as_given() -> None:
    assert served_name("smollm2-135m") == "smollm2-135m"
    assert served_name("not-a-folder-here") == "not-a-folder-here"


def test_a_folder_is_served_by_its_own_name_not_the_hosts_path(tmp_path: Path) -> None:
    """A host serving /home/ana/models/qwen3-8b made every client name that path."""
    folder = tmp_path / "models" / "qwen3-8b"
    folder.mkdir(parents=True)
    assert served_name(str(folder)) == "qwen3-8b"
    assert served_name(f"{folder}/") == "qwen3-8b"
    assert served_name(folder / ".." / "qwen3-8b") == "qwen3-8b"


def test_a_hugging_face_cache_snapshot_is_served_as_its_repository(tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "12fd25f7"
    snapshot.mkdir(parents=True)
    assert served_name(snapshot) == "HuggingFaceTB/SmolLM2-135M"


def test_a_planning_preset_without_weights_says_where_its_weights_come_from(
    tmp_path: Path, monkeypatch
) -> None:
    # `kafila plan --model qwen3-8b` plans from its shapes; `kafila host --model qwen3-8b` said only
    # "unknown model 'qwen3-8b'", as if the name were a typo
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFound) as err:
        resolve("Qwen3-8B", progress=False)
    assert str(err.value) == (
        "model 'Qwen3-8B' is a planning preset (`kafila plan --model Qwen3-8B`), and its weights are not "
        "here: download Qwen/Qwen3-8B (config.json, safetensors, tokenizer.json) and pass its folder, "
        f"or put it at {tmp_path / 'models' / 'qwen3-8b'}"
    )


def test_a_near_miss_is_answered_with_the_model_it_may_mean(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFound, match=r"^unknown model 'smollm': .*; did you mean 'smollm2-135m'\? "):
        resolve("smollm", progress=False)
    with pytest.raises(
        ModelNotFound, match=r"^unknown model 'SmolLM2-135M': .*; did you mean 'smollm2-135m'\? "
    ):
        resolve("SmolLM2-135M", progress=False)  # a preset too, but one whose weights are here
    with pytest.raises(ModelNotFound) as err:
        resolve("zzz", progress=False)
    assert "did you mean" not in str(err.value)
