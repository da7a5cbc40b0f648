"""Single-process generation on tiny checkpoints, and the real default model answering."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kafila.engine.draft import DraftPolicy
from kafila.engine.generate import Timings, generate
from kafila.engine.sampler import SamplingParams
from kafila.engine.stage import ContextFullError, Stage
from kafila.models.checkpoint import Checkpoint

PROMPT = [4, 8, 15, 16, 23, 42, 7, 9]


@pytest.fixture(scope="module")
def stage(tiny_checkpoint) -> Stage:
    ckpt = Checkpoint.open(tiny_checkpoint("qwen3-gqa4-tied"))
    return Stage.load(ckpt, range(ckpt.n_blocks), True, backend="torch", dtype="fp32", context=40)


def test_chunked_prefill_gives_the_same_tokens(stage: Stage) -> None:
    whole = list(generate(stage, PROMPT, SamplingParams(max_tokens=10)))
    chunked = list(generate(stage, PROMPT, SamplingParams(max_tokens=10), chunk=3))
    assert whole == chunked and len(whole) == 10
    assert stage.open_requests == []  # the slot was given back


def test_stops_on_eos_and_records_timings(stage: Stage) -> None:
    first_two = list(generate(stage, PROMPT, SamplingParams(max_tokens=2)))
    t = Timings()
    out = list(generate(stage, PROMPT, SamplingParams(max_tokens=10), eos_ids=(first_two[1],), timings=t))
    assert out == first_two and t.stop_reason == "stop"
    assert (t.prompt_tokens, t.generated_tokens) == (len(PROMPT), 2)
    assert t.prefill_s > 0 and t.decode_s > 0 and t.prefill_tps > 0 and t.decode_tps > 0


def test_generation_stops_at_the_context_end(stage: Stage) -> None:
    t = Timings()
    out = list(generate(stage, PROMPT, SamplingParams(max_tokens=100), timings=t))
    assert len(out) == 40 - len(PROMPT) and t.stop_reason == "length"  # prompt + answer = context


def test_seeded_sampling_repeats(stage: Stage) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=12)
    assert list(generate(stage, PROMPT, p)) == list(generate(stage, PROMPT, p))


def test_prompt_longer_than_the_context_is_refused_by_numbers(stage: Stage) -> None:
    with pytest.raises(ContextFullError, match="the prompt has 45 tokens; the context of 40 tokens"):
        list(generate(stage, list(range(45)), SamplingParams()))
    assert stage.open_requests == []


def test_a_prefill_chunk_below_one_token_is_refused(stage: Stage) -> None:
    with pytest.raises(ValueError, match="prefill chunk must be at least 1 token, got 0"):
        list(generate(stage, PROMPT, SamplingParams(), chunk=0))
    assert stage.open_requests == []


def test_a_prompt_token_outside_the_vocabulary_is_refused(stage: Stage) -> None:
    """A tokenizer.json from another model gives ids the embedding cannot take (an IndexError before)."""
    vocab = stage.config.vocab_size
    with pytest.raises(ValueError, match=f"prompt token {vocab} is outside the model's vocabulary"):
        list(generate(stage, [1, vocab], SamplingParams(max_tokens=2)))


def test_kafila_run_and_a_session_prefill_in_the_same_chunks() -> None:
    """A prompt longer than a chunk gives the same greedy tokens in `kafila run` and in a session
    only if both cut it at the same places: one default for both, and --chunk in both."""
    import argparse
    import inspect

    from kafila.cli import host, run
    from kafila.demo.fleet import LocalFleet
    from kafila.engine import PREFILL_CHUNK
    from kafila.session.ring.head import RingHead
    from kafila.session.ring.schedule import Schedule
    from kafila.session.terms import Options

    defaults = []
    for command in (host, run):
        parser = argparse.ArgumentParser()
        command.configure(parser)
        defaults.append(parser.get_default("chunk"))
    defaults += [Options().chunk, inspect.signature(generate).parameters["chunk"].default]
    assert defaults == [PREFILL_CHUNK] * 4
    # and where a session passes it on: the local fleet's flag, the head, its schedule
    inner = [
        LocalFleet.__dataclass_fields__["chunk"].default,
        inspect.signature(RingHead).parameters["chunk"].default,
        Schedule(concurrency=1).chunk,
    ]
    assert inner == [PREFILL_CHUNK] * 3


QUESTION = "What is the capital of France?"


def cli(*argv: str, stdin: str = "") -> tuple[int, str, str]:
    """`kafila ...` in a fresh process, as a person runs it (`stdin` piped in)."""
    out = subprocess.run(
        [sys.executable, "-m", "kafila", *argv], input=stdin, capture_output=True, text=True, timeout=600
    )
    return out.returncode, out.stdout, out.stderr


@pytest.mark.slow
def test_kafila_run_answers_paris_on_torch(smollm2_path) -> None:
    code, out, err = cli(
        "run", QUESTION, "--model", str(smollm2_path), "--backend", "torch", "--max-tokens", "16"
    )
    assert code == 0 and "Paris" in out
    assert "prefill: " in err and "tok/s" in err and "torch/cpu/fp32" in err


@pytest.mark.slow
def test_kafila_run_reads_a_piped_prompt(smollm2_path) -> None:
    """`echo "The capital of France is" | kafila run --raw`: the pipe's text, without echo's line
    break (which the model would otherwise continue after), is the prompt."""
    code, out, _ = cli(
        "run", "--model", str(smollm2_path), "--raw", "--max-tokens", "3", stdin="The capital of France is\n"
    )
    assert code == 0 and out.startswith(" Paris")


@pytest.mark.slow
def test_kafila_run_says_which_limit_a_length_stop_ran_into(smollm2_path) -> None:
    story = "Once upon a time"  # 4 tokens, a continuation that does not end by itself in 6 tokens
    run = ("run", story, "--model", str(smollm2_path), "--raw")
    code, _, err = cli(*run, "--max-tokens", "6")
    assert code == 0 and "stop: length (--max-tokens 6)" in err
    code, _, err = cli(*run, "--max-tokens", "50", "--context", "8")
    assert code == 0 and "stop: length (--context 8 full (4 prompt tokens))" in err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--raw", "--system", "Be brief."], "--system has no place with --raw: the prompt is plain text"),
        (["--context", "100000"], "--context 100000 is beyond the 8192 positions"),
        (["--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
        (["--temperature", "inf"], "temperature must be a finite number >= 0, got inf"),
        (["--repeat-penalty", "0"], "repeat_penalty must be a finite number > 0, got 0.0"),
        (["--presence-penalty", "3"], "presence_penalty must be in [-2, 2], got 3.0"),
    ],
)
def test_kafila_run_refuses_what_it_would_ignore_or_break_on(
    smollm2_path, extra: list[str], named: str
) -> None:
    code, _, err = cli("run", "Hi", "--model", str(smollm2_path), *extra)
    assert code == 2 and named in err and "Traceback" not in err


@pytest.mark.slow
def test_greedy_answer_is_paris_on_mlx(smollm2_path) -> None:
    pytest.importorskip("mlx.core")
    from kafila.engine.tokenizer import Tokenizer

    ckpt = Checkpoint.open(smollm2_path)
    tok = Tokenizer.from_checkpoint(ckpt)
    ids = tok.encode_chat([{"role": "user", "content": QUESTION}])
    stage = Stage.load(ckpt, range(ckpt.n_blocks), True, backend="mlx", dtype="fp32", context=128)
    answer = tok.decode(
        list(generate(stage, ids, SamplingParams(max_tokens=16), eos_ids=tuple(tok.stop_ids)))
    )
    assert "Paris" in answer


@pytest.mark.slow
def test_kafila_run_refuses_a_prompt_longer_than_the_context(smollm2_path) -> None:
    code, _, err = cli("run", QUESTION * 4, "--model", str(smollm2_path), "--raw", "--context", "16")
    assert code == 2
    assert "kafila run: error: the prompt has" in err and "the context of 16 tokens" in err


REPEATING = [4, 8, 15, 16, 23, 42, 7, 9] * 2  # a prompt the answer can copy from


@pytest.fixture(scope="module")
def long_stage(tiny_checkpoint) -> Stage:
    ckpt = Checkpoint.open(tiny_checkpoint("qwen3-gqa4-tied"))
    return Stage.load(ckpt, range(ckpt.n_blocks), True, "torch", "fp32", context=64, concurrency=2)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=40), SamplingParams(temperature=1.0, top_p=0.95, seed=5, max_tokens=40)],
    ids=["greedy", "seeded"],
)
def test_drafting_gives_the_plain_tokens_in_fewer_steps(long_stage: Stage, params: SamplingParams) -> None:
    plain, drafted = Timings(), Timings()
    expected = list(generate(long_stage, REPEATING, params, timings=plain))
    got = list(generate(long_stage, REPEATING, params, timings=drafted, draft=DraftPolicy(row_share=0.0)))
    assert got == expected and len(got) == 40
    assert plain.steps == 39 and drafted.drafted > 0
    assert drafted.steps == 39 - drafted.accepted  # each kept draft token saved a step
    if params.temperature == 0:
        assert drafted.accepted > 0  # the tiny model's greedy answer repeats itself


def test_a_simulated_backend_without_row_exact_steps_keeps_greedy_tokens(long_stage: Stage) -> None:
    """tie_margin as a backend whose batched rows may round differently: rows within the margin
    are sampled alone in the next step, the tokens stay the plain ones."""
    params, t = SamplingParams(max_tokens=40), Timings()
    expected = list(generate(long_stage, REPEATING, params))
    policy = DraftPolicy(row_share=0.0)
    got = list(generate(long_stage, REPEATING, params, timings=t, draft=policy, tie_margin=0.5))
    assert got == expected and t.steps > 39 - t.accepted  # some steps ended at a tie


def test_a_verification_steps_rows_have_the_bits_of_one_row_decode_steps(long_stage: Stage) -> None:
    """On the CPU kernels each row of a several-row decode step is computed as alone, so greedy
    verification needs no tie guard there (Stage.batch_rows)."""
    tokens = [5, 77, 31, 140, 9]
    stage = long_stage
    stage.open("a")
    stage.open("b")
    try:
        for rid in ("a", "b"):
            stage.forward([(rid, 0, stage.embed(REPEATING))])
        one = [_logits(stage, "a", 16 + i, t) for i, t in enumerate(tokens)]
        stage.forward([("b", 16, stage.embed([1, 2, 3, 4, 5, 6, 7]))], rowwise=True)  # a draft, then rejected
        [rows] = stage.forward([("b", 16, stage.embed(tokens))], rowwise=True)  # written again from 16
        assert np.array_equal(stage.logits(rows), np.stack(one))
        assert stage.length("b") == 21
    finally:
        stage.close("a")
        stage.close("b")


def _logits(stage: Stage, rid: str, position: int, token: int) -> np.ndarray:
    """One plain decode step's logits."""
    [hidden] = stage.forward([(rid, position, stage.embed([token]))])
    return stage.logits(hidden[-1])


@pytest.mark.slow
def test_kafila_run_with_a_draft_model_answers_as_without(smollm2_path) -> None:
    """`--draft MODEL`: the default model drafting for itself (the same tokenizer, every greedy
    draft its own token) gives the answer plain decoding gives."""
    run = ("run", QUESTION, "--model", str(smollm2_path), "--backend", "torch", "--max-tokens", "12")
    code, plain_out, _ = cli(*run, "--draft", "none")
    assert code == 0
    code, out, err = cli(*run, "--draft", str(smollm2_path))
    assert code == 0 and out == plain_out
    assert "drafted tokens kept" in err, err


def test_kafila_run_refuses_a_draft_model_of_another_vocabulary(smollm2_path, tiny_checkpoint) -> None:
    code, _, err = cli(
        "run", "Hi", "--model", str(smollm2_path), "--draft", str(tiny_checkpoint("qwen3-gqa4-tied"))
    )
    assert code == 2 and "vocabulary of 256 tokens, the served model 49152" in err, err
