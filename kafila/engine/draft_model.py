"""A draft model: a small model with the target's tokenizer, held by the head next to its sampler,
proposing the next k tokens of a request for one verification step (kafila.engine.speculative).

The draft model is a whole model on one `Stage` (every block and the head) with a KV cache of
its own per request. Each proposal feeds it what it has not seen of the request's prompt and
answer so far (after a rejected draft: from the first position its cache disagrees on, which the
stage writes over) and then runs k - 1 greedy one-token steps of its own, so a step costs the
draft model about k decode steps, on the head's model thread, before the circuit leaves.

Its drafts are its greedy tokens: one token per position (a point mass), for which verification
is the standard speculative-sampling rule, so greedy answers are those of plain decoding and
sampled answers keep the target model's distribution (kafila.engine.speculative).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kafila.engine import PREFILL_CHUNK
from kafila.engine.stage import RequestId, Stage


class DraftModelError(ValueError):
    """A draft model that cannot draft for this target (another vocabulary, a shorter context)."""


class DraftModel:
    """Greedy drafts of a whole small model on `stage`, one KV slot per open request."""

    def __init__(self, stage: Stage, name: str, chunk: int = PREFILL_CHUNK) -> None:
        whole = stage.blocks.start == 0 and stage.blocks.stop == stage.config.num_hidden_layers
        if not stage.head or not whole:
            raise DraftModelError(f"draft model {name}: needs a stage holding every block and the head")
        self.stage, self.name, self.chunk = stage, name, chunk
        # what each request's cache holds, by position; least recently drafted for first
        self._fed: OrderedDict[RequestId, list[int]] = OrderedDict()

    def check_target(self, vocab_size: int, context: int) -> None:
        """Raise DraftModelError unless this draft model can draft for a target of `vocab_size`
        tokens serving `context` positions."""
        mine = self.stage.config.vocab_size
        if mine != vocab_size:
            raise DraftModelError(
                f"draft model {self.name} has a vocabulary of {mine} tokens, the served model {vocab_size}: "
                "a draft model needs the served model's tokenizer"
            )
        if self.stage.context < context:
            raise DraftModelError(
                f"draft model {self.name}: its context of {self.stage.context} positions is shorter than "
                f"the served {context}"
            )

    def propose(self, rid: RequestId, history: Sequence[int], k: int) -> tuple[int, ...]:
        """The draft model's next `k` greedy tokens after `history` (prompt and answer so far):
        fewer where its context ends first, () for k < 1 or an empty history."""
        k = min(k, self.stage.context - len(history))
        if k < 1 or not history:
            return ()
        fed = self._open(rid)
        same = _common(fed, history)
        start = min(same, len(history) - 1)  # at least the last token is fed: its row drafts the first
        hidden = self._feed(rid, start, history[start:])
        del fed[start:]
        fed.extend(history[start:])
        out: list[int] = []
        while True:
            token = int(np.argmax(self.stage.logits(hidden)))
            out.append(token)
            if len(out) == k:
                return tuple(out)
            [rows] = self.stage.forward([(rid, len(fed), self.stage.embed([token]))])
            fed.append(token)
            hidden = rows[-1]

    def catch_up(self, rid: RequestId, history: Sequence[int]) -> None:
        """Feed what this model has not seen of `history` but its last token (which `propose`
        feeds, its row drafting the first token): a prompt's worth after a prefill, a token or two
        after a verified step. The head runs it while the prompt's prefill is around the ring, and
        apart from `propose` so that the time a draft takes (which prices drafting) is the draft's."""
        if len(history) < 2:
            return
        fed = self._open(rid)
        same = _common(fed, history[:-1])
        if same < len(history) - 1:
            self._feed(rid, same, history[same:-1])
            del fed[same:]
            fed.extend(history[same:-1])

    def close(self, rid: RequestId) -> None:
        """Free `rid`'s slot (unknown ids are ignored)."""
        self._fed.pop(rid, None)
        self.stage.close(rid)

    def _open(self, rid: RequestId) -> list[int]:
        """`rid`'s fed tokens, its slot opened where it has none. Where every slot is taken (a
        request that ended without `close`: failed, or carried into a new epoch), the least
        recently drafted for gives its slot up; it is fed again should it draft once more."""
        if rid in self._fed:
            self._fed.move_to_end(rid)
            return self._fed[rid]
        if len(self._fed) >= self.stage.concurrency:
            self.close(next(iter(self._fed)))
        self.stage.open(rid)
        self._fed[rid] = []
        return self._fed[rid]

    def _feed(self, rid: RequestId, start: int, tokens: Sequence[int]) -> Any:
        """Feed `tokens` from position `start` in prefill chunks; the last row's hidden state."""
        hidden = None
        for a in range(0, len(tokens), self.chunk):
            [hidden] = self.stage.forward([(rid, start + a, self.stage.embed(tokens[a : a + self.chunk]))])
        assert hidden is not None  # tokens is never empty
        return hidden[-1]


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def load_draft_model(model: str, target: Stage, quant: str = "auto") -> DraftModel:
    """Draft model `model` (a default model's name, a folder, or a cached model's name) loaded on
    `target`'s backend with its context and request slots; DraftModelError where it cannot draft
    for `target`."""
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.registry import resolve

    ckpt = Checkpoint.open(resolve(model), complete=True)
    if ckpt.config.vocab_size != target.config.vocab_size:  # before any weight is read
        raise DraftModelError(
            f"draft model {model} has a vocabulary of {ckpt.config.vocab_size} tokens, the served model "
            f"{target.config.vocab_size}: a draft model needs the served model's tokenizer"
        )
    stage = Stage.load(
        ckpt, range(ckpt.n_blocks), True, backend=target.backend, context=target.context,
        concurrency=target.concurrency, quant=quant,
    )  # fmt: skip
    draft = DraftModel(stage, model)
    draft.check_target(target.config.vocab_size, target.context)
    return draft
