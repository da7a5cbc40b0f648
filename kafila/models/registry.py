"""Model names -> Hugging Face folders: the default models (converted on first use) and folders.

`resolve("smollm2-135m")` converts the default model if needed and returns its folder;
`resolve("/path/to/folder")` returns the folder; a name of a folder under the cache's models/ works
too; a GGUF file (`/path/model.gguf`) or an Ollama store model (`ollama:NAME[:TAG]`) is converted
once into a packed folder (kafila.models.gguf_convert) and that folder returned. `available()`
lists all of them for `kafila models`.

Cache: `$KAFILA_CACHE`, else `$XDG_CACHE_HOME/kafila`, else `~/.cache/kafila`; models live in
`<cache>/models/<name>/`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from kafila.models import ollama
from kafila.models.cache import cache_dir as cache_dir
from kafila.models.cache import models_dir as models_dir
from kafila.models.default import (
    DEFAULT_MODELS,
    DefaultModelUnavailable,
    GGUFFile,
    default_folder,
    ensure_default,
    is_converted,
    locate_gguf,
)
from kafila.models.gguf_convert import ensure_gguf, is_gguf
from kafila.models.presets import PRESET_SOURCES


class ModelNotFound(ValueError):
    """A --model value that is neither a known name nor a model folder."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    architecture: str  # config.json model_type, e.g. "llama"
    blocks: int
    size_bytes: int  # weights on disk once converted (F32 for the default models)
    path: Path
    converted: bool  # False: a default model whose folder is written on first use
    description: str = ""


def resolve(name_or_path: str | os.PathLike[str], progress: bool = True, quant: str = "none") -> Path:
    """A default model's name (converted on first use), a model folder, or a folder name in the cache.
    A default model in `quant` "q4" is its GGUF's own packed blocks (default.ensure_default's
    `packed`); in the other formats its F32 folder (packed on load for "int8")."""

    text = os.fspath(name_or_path)
    if text in DEFAULT_MODELS:
        return ensure_default(text, progress=progress, packed=quant == "q4")
    local = local_model(text, progress)
    if local is not None:
        return local
    path = Path(text).expanduser()
    if path.is_dir():
        return path.resolve()
    cached = models_dir() / text
    if os.sep not in text and (cached / "config.json").is_file():
        return cached
    raise ModelNotFound(_not_found(text))


def local_model(text: str, progress: bool = True) -> Path | None:
    """The folder of a GGUF file (`*.gguf`) or an Ollama store model (`ollama:NAME[:TAG]`),
    converted on first use (kafila.models.gguf_convert); None for any other --model value."""
    if text.startswith(ollama.PREFIX):
        found = ollama.locate(text)
        return ensure_gguf(found.model, progress=progress, defaults=ollama.request_defaults(found.params))
    if is_gguf(text):
        return ensure_gguf(Path(text), progress=progress)
    return None


def _not_found(text: str) -> str:
    """Why `text` names no model here, and what would: a planning preset's source, a near name."""
    import difflib

    names = [e.name for e in available()]
    source = PRESET_SOURCES.get(text.lower())
    if source is not None and text.lower() not in names:  # `kafila plan` knows only its shapes
        return (
            f"model {text!r} is a planning preset (`kafila plan --model {text}`), and its weights are "
            f"not here: download {source} (config.json, safetensors, tokenizer.json) and pass its "
            f"folder, or put it at {models_dir() / text.lower()}"
        )
    if text.lower().endswith(".gguf"):
        return f"no GGUF file at {text!r} ({Path(text).expanduser().resolve()} does not exist)"
    near = difflib.get_close_matches(text.lower(), names, n=1, cutoff=0.6)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return (
        f"unknown model {text!r}: not a model name nor a folder; {hint}available: {', '.join(names)} "
        f"(or pass the path of a Hugging Face folder with config.json and safetensors)"
    )


def served_name(name_or_path: str | os.PathLike[str]) -> str:
    """The name a session serves a model under (the API's model id): a model name as given; a
    folder by its own name, not this machine's path (clients elsewhere name the model), and a
    Hugging Face cache snapshot (models--ORG--NAME/snapshots/REVISION) as ORG/NAME."""

    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if text.startswith(ollama.PREFIX):
        return ollama.parse(text).name
    if is_gguf(text):  # the file's name, not this machine's path
        return path.name.removesuffix(".gguf")
    if text in DEFAULT_MODELS or not path.is_dir():
        return text
    path = path.resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name or text


def available() -> list[ModelEntry]:
    """Default models (converted or not), every model folder in the cache, then the Ollama store's
    models (kafila.models.ollama)."""

    entries = [_default_entry(name) for name in DEFAULT_MODELS]
    root = models_dir()
    if root.is_dir():
        for folder in sorted(root.iterdir()):
            if folder.name in DEFAULT_MODELS or folder.name.startswith("."):
                continue
            entry = _folder_entry(folder.name, folder)
            if entry is not None:
                entries.append(entry)
    return entries + [_ollama_entry(m) for m in ollama.models()]


def _ollama_entry(model: ollama.OllamaModel) -> ModelEntry:
    """An Ollama store model from its GGUF's header (architecture, blocks; size: the blob's)."""
    from kafila.models.gguf_convert import folder_for

    try:
        meta = GGUFFile.open(model.model).meta
        arch = str(meta.get("general.architecture", "?"))
        blocks = int(meta.get(f"{arch}.block_count") or 0)
    except (OSError, ValueError, KeyError):  # not a GGUF Kafila reads: listed, never a crash
        arch, blocks = "? (not a readable GGUF)", 0
    converted = (folder_for(model.model) / "config.json").is_file()
    name = ollama.PREFIX + model.ref.name
    return ModelEntry(name, arch, blocks, model.size_bytes, model.model, converted, "Ollama store")


def _default_entry(name: str) -> ModelEntry:

    model = DEFAULT_MODELS[name]
    folder = default_folder(name)
    if is_converted(name):
        entry = _folder_entry(name, folder)
        if entry is not None:
            return ModelEntry(**{**entry.__dict__, "description": model.description})
    arch, blocks, size = _gguf_summary(name)
    return ModelEntry(name, arch, blocks, size, folder, converted=False, description=model.description)


def _gguf_summary(name: str) -> tuple[str, int, int]:
    """(architecture, blocks, F32 bytes) from the GGUF's header; zeros if the package is missing."""

    try:
        file = locate_gguf(DEFAULT_MODELS[name])
    except DefaultModelUnavailable:
        return ("?", 0, 0)
    gf = GGUFFile.open(file)
    arch = str(gf.meta["general.architecture"])
    return (arch, int(gf.meta[f"{arch}.block_count"]), 4 * sum(t.numel for t in gf.tensors))


def _folder_entry(name: str, folder: Path) -> ModelEntry | None:
    """A summary from config.json and the safetensors sizes; None if it is not a model folder."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):  # not JSON, not UTF-8: listed as unreadable, never a crash
        config = None
    if not isinstance(config, dict):
        config = {"model_type": "? (config.json unreadable)"}
    blocks = config.get("num_hidden_layers")
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors") if f.is_file())
    return ModelEntry(
        name=name,
        architecture=str(config.get("model_type", "?")),
        blocks=blocks if isinstance(blocks, int) and not isinstance(blocks, bool) else 0,
        size_bytes=size,
        path=folder,
        converted=True,
    )
