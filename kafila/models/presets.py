"""Model presets for planning: the real Hugging Face configs, so no weights are needed to plan.

`resolve_model(spec, dtype)` takes a preset name (qwen3-8b, qwen3-14b, qwen3-32b,
smollm2-135m; case-insensitive) or a local Hugging Face folder, and returns its ModelConfig and
Manifest (`resolve_config` and `resolve_manifest` one of them).
Pure except for reading a folder's headers when given a path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kafila.models.config import ModelConfig
from kafila.models.manifest import RUNTIME_DTYPES, Manifest, build_manifest, specs_from_config

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 128,
    "vocab_size": 151936,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

# Values of Qwen/Qwen3-{8B,14B,32B}/config.json and HuggingFaceTB/SmolLM2-135M-Instruct.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": _QWEN3_COMMON
    | {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "intermediate_size": 12288},
    "qwen3-14b": _QWEN3_COMMON
    | {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40, "intermediate_size": 17408},
    "qwen3-32b": _QWEN3_COMMON
    | {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64, "intermediate_size": 25600},
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


# where each preset's weights are published (what to download to serve it, not only plan it)
PRESET_SOURCES: dict[str, str] = {
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-14b": "Qwen/Qwen3-14B",
    "qwen3-32b": "Qwen/Qwen3-32B",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


def preset_config(name: str) -> ModelConfig:
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)}")
    return ModelConfig.from_dict(PRESETS[key])


def resolve_config(spec: str) -> ModelConfig:
    """A preset name or a local Hugging Face folder -> its ModelConfig."""
    if spec.lower() in PRESETS:
        return preset_config(spec)
    from kafila.models.checkpoint import Checkpoint

    return Checkpoint.open(_folder(spec), complete=True).config


def resolve_manifest(spec: str, dtype: str = "bf16") -> Manifest:
    """A preset name or a local Hugging Face folder -> Manifest priced at `dtype`."""
    return resolve_model(spec, dtype)[1]


def resolve_model(spec: str, dtype: str = "bf16", quant: str = "auto") -> tuple[ModelConfig, Manifest]:
    """A preset name or a local Hugging Face folder -> its ModelConfig and Manifest priced at `dtype`
    in weight format `quant` ("none", "int8", "q4"; "auto": as stored, floats for a preset)
    (a folder is opened once)."""
    fmt = None if quant == "auto" else quant
    st_dtype = RUNTIME_DTYPES.get(dtype.lower())
    if st_dtype is None:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(RUNTIME_DTYPES)}")
    if spec.lower() in PRESETS:
        config = preset_config(spec)
        return config, build_manifest(specs_from_config(config, st_dtype), config, quant=fmt)
    from kafila.models.checkpoint import Checkpoint

    checkpoint = Checkpoint.open(_folder(spec), complete=True)
    return checkpoint.config, checkpoint.manifest(st_dtype, fmt)


def _folder(spec: str) -> Path:
    """`spec` as a model folder (a GGUF file or an Ollama model converted into one); ValueError
    naming the presets when it is no folder either."""
    from kafila.models.gguf_convert import ensure_gguf, is_gguf
    from kafila.models.ollama import PREFIX, locate, request_defaults

    if spec.startswith(PREFIX):
        return ensure_gguf(locate(spec).model, defaults=request_defaults(locate(spec).params))
    if is_gguf(spec):
        return ensure_gguf(Path(spec))
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {spec!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a folder")
    return path
