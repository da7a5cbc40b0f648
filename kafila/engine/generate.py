"""Single-process generation: one Stage holding every block and the head.

`generate(stage, prompt_ids, params)` prefills the prompt in chunks, then decodes one token per
step, yielding token ids as they are sampled; `timings` records prefill and decode separately.
With a `draft` policy each decode step also feeds the tokens prompt lookup drafts and keeps those
the model agrees with (kafila.engine.draft, kafila.engine.speculative): the same tokens, fewer
steps where the answer repeats its prompt; with a `drafter` too, a draft model
(kafila.engine.draft_model) drafts instead of prompt lookup.
Text streaming is the tokenizer's (`kafila.engine.tokenizer.Tokenizer.stream()`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kafila.engine import PREFILL_CHUNK
from kafila.engine import draft as drafting
from kafila.engine.draft_model import DraftModel
from kafila.engine.sampler import Sampler, SamplingParams, StopReason
from kafila.engine.speculative import verify
from kafila.engine.stage import ContextFullError, RequestId, Stage


@dataclass
class Timings:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0  # prompt forward + first token
    decode_s: float = 0.0  # every later token
    stop_reason: StopReason | None = None
    steps: int = 0  # decode steps (each one circuit of the model)
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # ... and kept

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


def generate(
    stage: Stage,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    eos_ids: tuple[int, ...] = (),
    chunk: int = PREFILL_CHUNK,
    rid: RequestId = "local",
    timings: Timings | None = None,
    draft: drafting.DraftPolicy | None = None,
    tie_margin: float = 0.0,
    drafter: DraftModel | None = None,
) -> Iterator[int]:
    """Yield generated token ids (the stop token included when generation ends on one). `draft`:
    speculative decoding with prompt lookup, or with `drafter`'s drafts where it is given;
    `tie_margin`: kafila.engine.speculative.verify's."""
    if not stage.head or stage.blocks.start != 0 or stage.blocks.stop != stage.config.num_hidden_layers:
        raise ValueError("generate() needs a stage holding every block and the head")
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if chunk < 1:
        raise ValueError(f"the prefill chunk must be at least 1 token, got {chunk}")
    problem = stage.config.token_problem(prompt_ids)
    if problem:  # e.g. a tokenizer.json from another model
        raise ValueError(problem)
    if len(prompt_ids) >= stage.context:
        raise ContextFullError(
            f"the prompt has {len(prompt_ids)} tokens; the context of {stage.context} tokens leaves no "
            "room to generate (raise --context or shorten the prompt)"
        )
    t = timings if timings is not None else Timings()
    t.prompt_tokens, sampler = len(prompt_ids), Sampler(params, eos_ids, prompt_ids)
    stage.open(rid)
    try:
        if draft is None:
            yield from _run(stage, list(prompt_ids), sampler, chunk, rid, t)
        else:
            proposer = None if drafter is None else functools.partial(drafter.propose, rid)
            catch_up = None if drafter is None else functools.partial(drafter.catch_up, rid)
            yield from _run_drafted(
                stage, list(prompt_ids), sampler, chunk, rid, t, draft, tie_margin, proposer, catch_up
            )
    finally:
        stage.close(rid)
        if drafter is not None:
            drafter.close(rid)


def _prefill(stage: Stage, prompt: list[int], sampler: Sampler, chunk: int, rid: RequestId) -> int:
    for a in range(0, len(prompt), chunk):
        [hidden] = stage.forward([(rid, a, stage.embed(prompt[a : a + chunk]))])
    return sampler.sample(stage.logits(hidden[-1]))


def _run(
    stage: Stage, prompt: list[int], sampler: Sampler, chunk: int, rid: RequestId, t: Timings
) -> Iterator[int]:
    start = time.perf_counter()
    token = _prefill(stage, prompt, sampler, chunk, rid)
    t.prefill_s, t.generated_tokens = time.perf_counter() - start, 1
    pos = len(prompt)
    yield token
    start = time.perf_counter()
    try:
        # prompt + answer tokens fit the context, as a session counts them (the API's max_tokens):
        # the last token would need no KV position, but a session's answer stops before it too
        while (reason := sampler.stop_reason(token)) is None and pos + 1 < stage.context:
            [hidden] = stage.forward([(rid, pos, stage.embed([token]))])
            token, pos = sampler.sample(stage.logits(hidden[-1])), pos + 1
            t.generated_tokens, t.steps = t.generated_tokens + 1, t.steps + 1
            t.decode_s = time.perf_counter() - start
            yield token
        t.stop_reason = reason or "length"
    finally:
        t.decode_s = time.perf_counter() - start


def _run_drafted(
    stage: Stage,
    prompt: list[int],
    sampler: Sampler,
    chunk: int,
    rid: RequestId,
    t: Timings,
    policy: drafting.DraftPolicy,
    tie_margin: float,
    proposer: drafting.Proposer | None,
    catch_up: Callable[[Sequence[int]], None] | None = None,
) -> Iterator[int]:
    """As `_run`, each step feeding the last token and a draft (`proposer`'s, else prompt
    lookup's), keeping what `verify` keeps; `catch_up` (the draft model's) reads the history
    before each draft, outside the draft's measured time."""
    start = time.perf_counter()
    token = _prefill(stage, prompt, sampler, chunk, rid)
    t.prefill_s, t.generated_tokens = time.perf_counter() - start, 1
    history, pos, stats, alone = [*prompt, token], len(prompt), drafting.DraftStats(), False
    yield token
    start = time.perf_counter()
    try:
        reason = sampler.stop_reason(token)
        while reason is None and pos + 1 < stage.context:
            room = min(sampler.params.max_tokens - sampler.generated - 1, stage.context - 2 - pos)
            if catch_up is not None and not alone:
                catch_up(history)  # a prompt's worth once: priced as drafting it would end drafting
            began = time.perf_counter()
            drafted = () if alone else drafting.propose(policy, stats, history, room, proposer)
            stats = drafting.observe_drafting(policy, stats, len(drafted), time.perf_counter() - began)
            began = time.perf_counter()
            [hidden] = stage.forward([(rid, pos, stage.embed([token, *drafted]))], rowwise=True)
            verdict = verify(sampler, stage.logits(hidden), drafted, tie_margin)
            took = time.perf_counter() - began
            stats = drafting.observe(policy, stats, len(drafted), verdict.accepted, took)
            t.steps, t.drafted = t.steps + 1, t.drafted + len(drafted)
            t.accepted += verdict.accepted
            alone, reason = verdict.tied, verdict.reason
            for tok in verdict.tokens:
                token, pos = tok, pos + 1
                history.append(tok)
                t.generated_tokens += 1
                t.decode_s = time.perf_counter() - start
                yield tok
        t.stop_reason = reason or "length"
    finally:
        t.decode_s = time.perf_counter() - start
