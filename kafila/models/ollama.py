"""Models in an Ollama store: `--model ollama:NAME[:TAG]` (files only; Ollama need not run).

The store is `$OLLAMA_MODELS`, else `~/.ollama/models`:

    manifests/registry.ollama.ai/library/NAME/TAG   JSON: {"layers": [{"mediaType", "digest"}, ...]}
    manifests/registry.ollama.ai/USER/NAME/TAG      (a `user/name` model)
    blobs/sha256-HEX                                 each layer's bytes, by digest

The layer `application/vnd.ollama.image.model` is the GGUF, served where it lies (no copy of its
weights is made: kafila.models.gguf_convert writes an index into the cache and
kafila.models.gguf_inplace makes the tensors from the blob when they are read); the layer
`application/vnd.ollama.image.params` is JSON whose `temperature`, `top_p` and `stop` are the
model's request defaults (`OllamaModel.params`). The tag is `latest` unless given.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "ollama:"
REGISTRY = "registry.ollama.ai"
MODEL_LAYER = "application/vnd.ollama.image.model"
PARAMS_LAYER = "application/vnd.ollama.image.params"


class OllamaModelNotFound(ValueError):
    """No such model in the store; the message lists the models it holds."""


@dataclass(frozen=True)
class OllamaRef:
    namespace: str  # "library" for NAME, USER for USER/NAME
    model: str
    tag: str

    @property
    def name(self) -> str:
        """The name Ollama shows: NAME:TAG (USER/NAME:TAG outside the library)."""
        base = self.model if self.namespace == "library" else f"{self.namespace}/{self.model}"
        return f"{base}:{self.tag}"


@dataclass(frozen=True)
class OllamaModel:
    ref: OllamaRef
    manifest: Path
    model: Path  # the GGUF blob
    size_bytes: int
    params: dict[str, Any] = field(default_factory=dict)


def store() -> Path:
    given = os.environ.get("OLLAMA_MODELS")
    return Path(given).expanduser() if given else Path.home() / ".ollama" / "models"


def parse(text: str) -> OllamaRef:
    """`ollama:NAME`, `ollama:NAME:TAG`, `ollama:USER/NAME[:TAG]` (the prefix may be left out)."""
    body = text.removeprefix(PREFIX)
    name, _, tag = body.partition(":")
    parts = name.split("/")
    if not name or len(parts) > 2 or not all(parts) or ".." in parts or (tag and "/" in tag):
        raise OllamaModelNotFound(f"{text!r} is not an Ollama model name (ollama:NAME[:TAG] or USER/NAME)")
    namespace, model = (parts[0], parts[1]) if len(parts) == 2 else ("library", parts[0])
    return OllamaRef(namespace, model, tag or "latest")


def locate(text: str, root: Path | None = None) -> OllamaModel:
    """The store's model `text`; OllamaModelNotFound listing what the store holds."""
    root = store() if root is None else root
    ref = parse(text)
    manifest = root / "manifests" / REGISTRY / ref.namespace / ref.model / ref.tag
    if not manifest.is_file():
        held = [m.ref.name for m in models(root)]
        listing = ", ".join(held) if held else "nothing"
        raise OllamaModelNotFound(
            f"no Ollama model {ref.name} in {root} (set OLLAMA_MODELS for another store); it holds {listing}"
        )
    return _read(root, ref, manifest)


def models(root: Path | None = None) -> list[OllamaModel]:
    """Every model the store holds with its GGUF present, by name."""
    root = store() if root is None else root
    base = root / "manifests" / REGISTRY
    if not base.is_dir():
        return []
    found = []
    for manifest in sorted(base.glob("*/*/*")):
        if not manifest.is_file():
            continue
        ref = OllamaRef(manifest.parent.parent.name, manifest.parent.name, manifest.name)
        try:
            found.append(_read(root, ref, manifest))
        except OllamaModelNotFound:
            continue  # a manifest without its model blob (a pull cut short) is not a model
    return found


def _read(root: Path, ref: OllamaRef, manifest: Path) -> OllamaModel:
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers") or []
    except (OSError, ValueError, AttributeError) as exc:
        raise OllamaModelNotFound(f"{manifest}: not an Ollama manifest ({exc})") from exc
    by_type = {layer.get("mediaType"): layer for layer in layers if isinstance(layer, dict)}
    layer = by_type.get(MODEL_LAYER)
    if layer is None:
        raise OllamaModelNotFound(f"{manifest}: no {MODEL_LAYER} layer")
    model = _blob(root, layer)
    if not model.is_file():
        raise OllamaModelNotFound(f"{manifest}: its model blob {model} is missing")
    params: dict[str, Any] = {}
    if PARAMS_LAYER in by_type:
        try:
            loaded = json.loads(_blob(root, by_type[PARAMS_LAYER]).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise OllamaModelNotFound(f"{manifest}: its params layer is unreadable ({exc})") from exc
        params = loaded if isinstance(loaded, dict) else {}
    return OllamaModel(ref, manifest, model, model.stat().st_size, params)


def _blob(root: Path, layer: dict[str, Any]) -> Path:
    digest = str(layer.get("digest", ""))
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or not hexdigest.isalnum():
        raise OllamaModelNotFound(f"layer digest {digest!r} is not sha256:HEX")
    return root / "blobs" / f"sha256-{hexdigest}"


def request_defaults(params: dict[str, Any]) -> dict[str, Any]:
    """The params layer's fields that are request defaults: temperature, top_p (numbers) and stop
    (strings), as generation_config.json carries them."""
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p"):
        v = params.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[key] = float(v)
    stop = params.get("stop")
    stops = [stop] if isinstance(stop, str) else stop
    if isinstance(stops, list) and all(isinstance(s, str) for s in stops):
        out["stop"] = list(stops)
    return out
