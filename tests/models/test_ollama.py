"""`--model ollama:NAME[:TAG]` and `--model FILE.gguf`: an Ollama store laid out as Ollama lays it
out (manifests by registry/namespace/name/tag, blobs by digest) around the default model's GGUF."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kafila.models import ollama
from kafila.models.checkpoint import Checkpoint
from kafila.models.registry import ModelNotFound, available, resolve, served_name

PARAMS = {"temperature": 0.2, "top_p": 0.9, "stop": ["<|im_end|>", "<|endoftext|>"], "num_ctx": 4096}


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    from kafila.models.default import DEFAULT_MODELS, DefaultModelUnavailable, locate_gguf

    try:
        return locate_gguf(DEFAULT_MODELS["smollm2-135m"])
    except DefaultModelUnavailable as exc:
        pytest.skip(str(exc))


def _blob(store: Path, data_file: Path | None = None, text: str | None = None) -> dict[str, object]:
    """Put a layer in blobs/ under its sha256 (a GGUF hard-linked where it can be, as big as it is)."""
    blobs = store / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    if data_file is not None:
        digest = hashlib.sha256(data_file.read_bytes()).hexdigest()
        target = blobs / f"sha256-{digest}"
        if not target.exists():
            try:
                os.link(data_file, target)
            except OSError:
                shutil.copyfile(data_file, target)
        size = data_file.stat().st_size
    else:
        raw = (text or "").encode()
        digest = hashlib.sha256(raw).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(raw)
        size = len(raw)
    return {"digest": f"sha256:{digest}", "size": size}


def _manifest(store: Path, namespace: str, name: str, tag: str, layers: list[dict[str, object]]) -> None:
    folder = store / "manifests" / ollama.REGISTRY / namespace / name
    folder.mkdir(parents=True, exist_ok=True)
    body = {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json"}
    (folder / tag).write_text(json.dumps({**body, "layers": layers}))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, gguf_file: Path) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("ollama") / "models"
    model = {"mediaType": ollama.MODEL_LAYER, **_blob(root, gguf_file)}
    params = {"mediaType": ollama.PARAMS_LAYER, **_blob(root, text=json.dumps(PARAMS))}
    template = {"mediaType": "application/vnd.ollama.image.template", **_blob(root, text="{{ .Prompt }}")}
    _manifest(root, "library", "smollm2", "latest", [model, template, params])
    _manifest(root, "someone", "tiny", "q4", [model])
    _manifest(root, "library", "gone", "latest", [{"mediaType": ollama.MODEL_LAYER, "digest": "sha256:00"}])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OLLAMA_MODELS", str(root))
        mp.setenv("KAFILA_CACHE", str(tmp_path_factory.mktemp("kafila-cache")))
        yield root


def test_names_parse_with_tag_latest_and_user_namespaces() -> None:
    assert ollama.parse("ollama:smollm2") == ollama.OllamaRef("library", "smollm2", "latest")
    assert ollama.parse("ollama:someone/tiny:q4") == ollama.OllamaRef("someone", "tiny", "q4")
    assert ollama.parse("ollama:qwen3:0.6b").name == "qwen3:0.6b"
    for bad in ("ollama:", "ollama:a/b/c", "ollama:../x", "ollama:x:a/b"):
        with pytest.raises(ollama.OllamaModelNotFound):
            ollama.parse(bad)


def test_store_model_is_its_gguf_blob_with_params_as_request_defaults(store: Path, gguf_file: Path) -> None:
    found = ollama.locate("ollama:smollm2")
    assert found.model.parent == store / "blobs" and found.model.name.startswith("sha256-")
    assert (
        found.model.stat().st_ino == gguf_file.stat().st_ino or found.size_bytes == gguf_file.stat().st_size
    )
    assert ollama.request_defaults(found.params) == {
        "temperature": 0.2,
        "top_p": 0.9,
        "stop": ["<|im_end|>", "<|endoftext|>"],
    }
    folder = resolve("ollama:smollm2", progress=False)
    source = json.loads((folder / "kafila_source.json").read_text())
    assert source["gguf"] == str(found.model.resolve())  # read from the blob where it lies
    ckpt = Checkpoint.open(folder, complete=True)
    assert (ckpt.config.model_type, ckpt.n_blocks, ckpt.stored_format) == ("llama", 30, "q4")
    assert served_name("ollama:smollm2") == "smollm2:latest"
    other = resolve("ollama:someone/tiny:q4", progress=False)  # the same blob, no params
    assert json.loads((other / "kafila_source.json").read_text())["gguf"] == source["gguf"]


def test_params_become_the_apis_request_defaults(store: Path) -> None:
    from kafila.api import ollama as ollama_api
    from kafila.api import openai
    from kafila.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_checkpoint(Checkpoint.open(resolve("ollama:smollm2", progress=False)))
    defaults = tok.request_defaults
    assert defaults == {"temperature": 0.2, "top_p": 0.9, "stop": ["<|im_end|>", "<|endoftext|>"]}
    job = openai.job_from({}, [1, 2, 3], 64, defaults=defaults)
    assert (job.sampling.temperature, job.sampling.top_p) == (0.2, 0.9)
    assert job.stop == ("<|im_end|>", "<|endoftext|>")
    job = openai.job_from({"temperature": 0.7, "stop": "x"}, [1, 2, 3], 64, defaults=defaults)
    assert (job.sampling.temperature, job.stop) == (0.7, ("x",))  # the request's own fields win
    job = ollama_api.job_from({"options": {"top_p": 0.5}}, [1, 2, 3], 64, defaults=defaults)
    assert (job.sampling.temperature, job.sampling.top_p, job.stop[0]) == (0.2, 0.5, "<|im_end|>")
    plain = Tokenizer.from_checkpoint(Checkpoint.open(resolve("ollama:someone/tiny:q4", progress=False)))
    assert plain.request_defaults == {}
    assert openai.job_from({}, [1, 2, 3], 64, defaults=plain.request_defaults).sampling.temperature == 1.0


def test_a_missing_model_lists_what_the_store_holds(store: Path) -> None:
    with pytest.raises(ollama.OllamaModelNotFound) as err:
        resolve("ollama:llama3.2:3b", progress=False)
    text = str(err.value)
    assert "no Ollama model llama3.2:3b" in text and "smollm2:latest, someone/tiny:q4" in text
    assert "gone" not in text.split("holds")[1]  # a manifest whose blob is missing is no model


def test_kafila_models_lists_the_store(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kafila.cli.models import configure, main

    names = {e.name: e for e in available()}
    entry = names["ollama:smollm2:latest"]
    assert (entry.architecture, entry.blocks) == ("llama", 30)
    import argparse

    parser = argparse.ArgumentParser()
    configure(parser)
    assert main(parser.parse_args(["--json"])) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {"ollama:smollm2:latest", "ollama:someone/tiny:q4"} <= {r["name"] for r in rows}


def test_a_gguf_path_is_a_model_for_run_host_and_plan(store: Path, gguf_file: Path) -> None:
    from kafila.models.presets import resolve_model

    folder = resolve(str(gguf_file), progress=False)
    assert served_name(str(gguf_file)) == "SmolLM2-135M-Instruct.Q4_1"
    config, manifest = resolve_model(str(gguf_file), "fp32")
    assert config == Checkpoint.open(folder).config
    assert manifest == Checkpoint.open(folder).manifest("F32")
    with pytest.raises(ModelNotFound, match="no GGUF file at"):
        resolve(str(gguf_file.with_name("missing.gguf")))
