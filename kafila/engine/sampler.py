"""Choosing the next token from logits (numpy, backend-neutral) and deciding when to stop.

Greedy when `temperature` is below GREEDY_BELOW (1e-5, as vLLM counts it: a smaller one leaves only
the most likely token, and near zero logits / temperature would overflow), or `top_k == 1`, or
`top_p == 0`; otherwise logits / temperature, then top-k, then top-p (the smallest set of tokens whose
probability reaches `top_p`, as transformers does), then min-p (only tokens at least `min_p`
times as likely as the most likely one stay, as llama.cpp and transformers do), then a draw.
Each answer position draws from its own generator, keyed by the request's seed and the
position, so a seeded request repeats exactly (any integer: a negative seed is read as the
64-bit pattern it has, so -1 is one fixed seed, not "random"), and a token does not depend on
how many positions one step verified (kafila.engine.speculative): the answer is the same with
drafts or without.

Penalties, applied to the logits before all of that (so greedy decoding takes them too), each off
by default:
- `repeat_penalty` (llama.cpp's and Ollama's, transformers' `repetition_penalty`): the logit of a
  token among the last `repeat_last_n` tokens of prompt and answer is divided by it where
  positive and multiplied by it where negative (> 1 discourages repeating).
- `presence_penalty` and `frequency_penalty` (OpenAI's, as vLLM reads them): a token's logit
  minus presence x (1 if the answer holds it) minus frequency x (how often the answer holds it).
"""

from __future__ import annotations

import math
import secrets
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1.0: no top-p
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64  # the window repeat_penalty looks at (prompt and answer); 0: off
    presence_penalty: float = 0.0  # OpenAI's range [-2, 2]; 0: off
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # 0.0: no min-p

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 < self.repeat_penalty < math.inf:
            raise ValueError(f"repeat_penalty must be a finite number > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise ValueError(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:  # also refuses NaN
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def repeats(self) -> bool:
        """repeat_penalty is on."""
        return self.repeat_penalty != 1.0 and self.repeat_last_n > 0


class Sampler:
    """One request's sampler: its parameters, its generator, what it has seen (for the penalties)
    and its stop rules."""

    def __init__(
        self, params: SamplingParams, eos_ids: tuple[int, ...] = (), prompt: Sequence[int] = ()
    ) -> None:
        self.params = params
        self.stop_ids = frozenset(eos_ids) | frozenset(params.stop_token_ids)
        # the key of every position's draw: the seed, or fresh entropy for an unseeded request
        self.key = secrets.randbits(64) if params.seed is None else params.seed % 2**64
        self.generated = 0
        n = params.repeat_last_n if params.repeats else 0
        self.recent: deque[int] = deque(prompt[-n:] if n else (), maxlen=n)  # repeat_penalty's window
        self.answer: Counter[int] = Counter()  # the answer's tokens so far, for presence/frequency

    @property
    def greedy(self) -> bool:
        """Only the most likely token can be chosen."""
        p = self.params
        return p.temperature < GREEDY_BELOW or p.top_k == 1 or p.top_p == 0

    def generator(self) -> np.random.Generator:
        """The generator of the position being sampled (the answer's `generated`-th token)."""
        return np.random.default_rng([self.key, self.generated])

    def sample(self, logits: np.ndarray) -> int:
        """logits [V] -> the next token id."""
        p = self.params
        if self.greedy:
            token = int(np.argmax(self.penalized(logits)))
        else:
            probs = distribution(self.penalized(logits), p.temperature, p.top_k, p.top_p, p.min_p)
            token = int(self.generator().choice(probs.shape[0], p=probs))
        self.generated += 1
        self.take(token)
        return token

    def take(self, token: int) -> None:
        """`token` joins the penalties' history."""
        p = self.params
        if self.recent.maxlen:
            self.recent.append(token)
        if p.presence_penalty or p.frequency_penalty:
            self.answer[token] += 1

    def replay(self, tokens: Sequence[int]) -> None:
        """`tokens` were sampled for this request elsewhere (by a head that was lost): count them
        and take them into the penalties' history, so the answer goes on as it would have (each
        position's draw is keyed by its index, so nothing else moves on)."""
        self.generated += len(tokens)
        for token in tokens:
            self.take(token)

    def rewound(self, prompt: Sequence[int], tokens: Sequence[int]) -> Sampler:
        """A sampler with this one's parameters and key in the state it had right after sampling
        `tokens` for `prompt`: for a request carried into a new epoch, where a sampling turn its
        head's pause cancelled may still have run on the model thread and moved this one on by a
        token nobody received (its count would end the answer one token early)."""
        fresh = Sampler(self.params, tuple(self.stop_ids), prompt)
        fresh.key = self.key
        fresh.replay(tokens)
        return fresh

    def penalized(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] with this request's penalties applied (the same array when none is on)."""
        p = self.params
        if not self.recent and not self.answer:
            return logits
        z = logits.astype(np.float32, copy=True)  # [V]
        if self.recent:
            ids = np.fromiter(set(self.recent), dtype=np.int64)
            seen = z[ids]
            z[ids] = np.where(seen > 0, seen / p.repeat_penalty, seen * p.repeat_penalty)
        if self.answer:
            ids = np.fromiter(self.answer.keys(), dtype=np.int64, count=len(self.answer))
            times = np.fromiter(self.answer.values(), dtype=np.float32, count=len(self.answer))
            z[ids] -= p.presence_penalty + p.frequency_penalty * times
        return z

    def stop_reason(self, token: int) -> StopReason | None:
        """After `token` was sampled: "stop" on EOS/stop tokens, "length" at max_tokens, else None."""
        if token in self.stop_ids:
            return "stop"
        if self.generated >= self.params.max_tokens:
            return "length"
        return None


def distribution(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
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
    if min_p > 0.0:
        probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs
