"""What name a session serves a model under: the API's model id, the same on every member."""

from __future__ import annotations

from pathlib import Path

from kafila.models.registry import served_name


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
