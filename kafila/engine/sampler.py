"""Choosing the next token from logits (numpy, backend-neutral) and deciding when to stop.

Greedy when `temperature == 0` (or `top_k == 1`, or `top_p == 0`: only the most likely token is
left); otherwise logits / temperature, then top-k, then top-p (the smallest set of tokens whose
probability reaches `top_p`, as transformers does), then a draw from the request's own generator,
seeded by `seed` so a seeded request repeats exactly (any integer: a negative seed is read as the
64-bit pattern it has, so -1 is one fixed seed, not "random").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1.0: no top-p
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


class Sampler:
    """One request's sampler: its parameters, its generator and its stop rules."""

    def __init__(self, params: SamplingParams, eos_ids: tuple[int, ...] = ()) -> None:
        self.params = params
        self.stop_ids = frozenset(eos_ids) | frozenset(params.stop_token_ids)
        self.rng = np.random.default_rng(None if params.seed is None else params.seed % 2**64)
        self.generated = 0

    def sample(self, logits: np.ndarray) -> int:
        """logits [V] -> the next token id."""
        p = self.params
        self.generated += 1
        if p.temperature == 0 or p.top_k == 1 or p.top_p == 0:
            return int(np.argmax(logits))
        probs = distribution(logits, p.temperature, p.top_k, p.top_p)
        return int(self.rng.choice(probs.shape[0], p=probs))

    def stop_reason(self, token: int) -> StopReason | None:
        """After `token` was sampled: "stop" on EOS/stop tokens, "length" at max_tokens, else None."""
        if token in self.stop_ids:
            return "stop"
        if self.generated >= self.params.max_tokens:
            return "length"
        return None


def distribution(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The probabilities [V] (float64, summing to 1) that sampling draws from."""
    z = logits.astype(np.float64) / temperature  # [V]
    if 0 < top_k < z.shape[0]:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    z -= z.max()
    probs = np.exp(z)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")  # most likely first
        cum = np.cumsum(probs[order])
        keep = cum - probs[order] < top_p  # keep tokens until the mass before them reaches top_p
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs
