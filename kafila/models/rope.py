"""Rotary position tables shared by every backend (numpy, float32, pure).

Rotate-half RoPE as Hugging Face computes it: `inv_freq[i] = 1 / theta^(2i/d)`, optionally rescaled
(`linear`, `llama3`, or `freq_factors`: a GGUF's `rope_freqs` tensor, each inverse frequency
divided by its factor as llama.cpp does), and tables `cos/sin[pos] = cos/sin(pos * [inv_freq,
inv_freq])`. The engine rotates with `x * cos + roll(x, d/2) * sin_signed`, where
`sin_signed = [-sin_half, sin_half]`; `roll(x, d/2) = [x2, x1]`, so this equals HF's
`x * cos + rotate_half(x) * sin` exactly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kafila.models.config import ROPE_SCALINGS, ModelConfig

SUPPORTED = tuple(ROPE_SCALINGS)


class RopeError(ValueError):
    """The checkpoint asks for a RoPE variant Kafila does not implement."""


def inv_freq(config: ModelConfig) -> np.ndarray:
    """[d/2] float32 inverse frequencies, with the config's rope scaling applied."""
    d = config.head_dim
    base = np.float32(config.rope_theta)
    freq = (np.float32(1.0) / base ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))).astype(
        np.float32
    )
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return freq
    if kind == "linear":
        return (freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "llama3":
        return _llama3(freq, scaling)
    if kind == "freq_factors":
        factors = np.asarray(scaling["freq_factors"], dtype=np.float32)
        if factors.shape != freq.shape:
            raise RopeError(f"{factors.size} RoPE frequency factors for a head of {d} ({d // 2} frequencies)")
        return (freq / factors).astype(np.float32)
    raise RopeError(f"rope_type {kind!r} is not supported; Kafila runs {list(SUPPORTED)}")


def _llama3(freq: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = np.float32(2 * math.pi) / freq
    scaled = np.where(wavelen > old / low, freq / np.float32(factor), freq).astype(np.float32)
    smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def tables(config: ModelConfig, context: int) -> tuple[np.ndarray, np.ndarray]:
    """cos [context, d] and sin_signed [context, d] (float32) for positions 0..context-1."""
    freq = inv_freq(config)
    angles = np.arange(context, dtype=np.float32)[:, None] * freq[None, :]  # [ctx, d/2]
    emb = np.concatenate([angles, angles], axis=-1)  # [ctx, d]
    cos = np.cos(emb).astype(np.float32)
    sin = np.sin(emb).astype(np.float32)
    half = freq.shape[0]
    sin[:, :half] *= -1  # sin_signed: roll(x) = [x2, x1] needs [-sin, +sin]
    return cos, sin
