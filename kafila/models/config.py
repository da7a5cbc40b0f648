"""A transformer's shape, parsed from a Hugging Face `config.json` (pure: no tensors, no files).

Only decoder-only Llama-family models are described: `llama` (SmolLM2, Llama 2/3) and `qwen3`
(adds q_norm/k_norm on each head). Unknown architectures are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ConfigError(ValueError):
    """config.json is missing a field or names something Kafila cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "llama" | "qwen3"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json's num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        for key in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, key)
            if not 0 < v < math.inf:
                raise ConfigError(f"config.json's {key} must be a finite number > 0, got {v!r}")
        _check_rope_scaling(self.rope_scaling)

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    def check_context(self, context: int, model: str, given: str = "--context") -> None:
        """Refuse a declared context (prompt plus answer) past the positions the model was trained
        for; `given` names where it came from (a flag or a file's field)."""
        positions = self.max_position_embeddings
        if context > positions:
            trained = f"the {positions} positions {model} was trained for"
            raise ConfigError(f"{given} {context} is beyond {trained}")

    def token_problem(self, ids: Iterable[int]) -> str | None:
        """What is wrong with prompt token ids for this model (the first id outside the vocabulary,
        which the embedding would fail on), or None."""
        outside = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if outside is None:
            return None
        return f"prompt token {outside} is outside the model's vocabulary (0-{self.vocab_size - 1})"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        for key in _COUNTS:
            v = d.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"config.json's {key} must be a whole number >= 1, got {v!r}")
        for key in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(d.get(key, False), bool):
                raise ConfigError(f"config.json's {key} must be true or false, got {d[key]!r}")
        for key, runs in _ONLY.items():  # what would otherwise be computed as if not asked
            if d.get(key) not in runs:
                allowed = " or ".join(repr(v) for v in runs[1:])
                raise ConfigError(f"config.json's {key} is {d[key]!r}; Kafila runs only {allowed}")
        model_type = d.get("model_type")
        if model_type not in ARCHITECTURES:
            archs = d.get("architectures") or []
            raise ConfigError(
                f"unknown architecture: model_type={model_type!r} architectures={archs!r}; "
                f"Kafila runs {sorted(ARCHITECTURES)}"
            )
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            eos = d.get("eos_token_id")
            rope = d.get("rope_parameters") or {}
            return cls(
                model_type=model_type,
                hidden_size=hidden,
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                intermediate_size=int(d["intermediate_size"]),
                vocab_size=int(d["vocab_size"]),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(
                    next((v for v in (d.get("rope_theta"), rope.get("rope_theta")) if v is not None), 1e4)
                ),
                rope_scaling=d.get("rope_scaling") or _scaling_from_parameters(rope),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                attention_bias=bool(d.get("attention_bias", False)),
                torch_dtype=d.get("torch_dtype") or d.get("dtype"),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
                raw=dict(d),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json has no {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:  # e.g. an eos_token_id or rms_norm_eps that is no number
            raise ConfigError(f"config.json: {exc}") from exc


# the RoPE scalings Kafila implements (kafila.models.rope) and the numbers each needs
ROPE_SCALINGS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "freq_factors": (),  # a GGUF's rope_freqs tensor: inv_freq[i] / freq_factors[i] (llama.cpp's)
}


def _positive(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float) and 0 < v < math.inf


def _check_rope_scaling(scaling: Any) -> None:
    """Refuse a rope_scaling Kafila would compute wrong or fail on later: named, with its field."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ConfigError(f"config.json's rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_SCALINGS:
        raise ConfigError(
            f"config.json's rope_scaling type {kind!r} is not supported; Kafila runs {list(ROPE_SCALINGS)}"
        )
    for key in ROPE_SCALINGS[kind]:
        v = scaling.get(key)
        if not _positive(v):
            raise ConfigError(
                f"config.json's rope_scaling.{key} ({kind}) must be a finite number > 0, got {v!r}"
            )
    if kind == "freq_factors":
        f = scaling.get("freq_factors")
        if not isinstance(f, list) or not f or not all(_positive(v) for v in f):
            raise ConfigError(
                "config.json's rope_scaling.freq_factors must be a list of finite numbers > 0 (one per "
                f"rotary frequency), got {str(f)[:80]}"
            )
    if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ConfigError(
            "config.json's rope_scaling.low_freq_factor must be below high_freq_factor (llama3)"
        )


# config fields whose other values change the computation Kafila does not implement: key -> the
# values it runs (None: absent)
_ONLY: dict[str, tuple[Any, ...]] = {
    "hidden_act": (None, "silu"),
    "mlp_bias": (None, False),
    "use_sliding_window": (None, False),
}

# counts that must be whole numbers >= 1 where config.json gives them (a 0 divides by zero later)
_COUNTS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings",
)  # fmt: skip


def _scaling_from_parameters(rope: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5 writes `rope_parameters`; only a non-default rope_type is a scaling."""
    kind = rope.get("rope_type", "default")
    return None if kind == "default" else dict(rope)
