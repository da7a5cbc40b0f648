"""`kafila run`: generate text with a model on this machine (one stage holding the whole model)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, TextIO

from kafila.cli.argtypes import positive_int
from kafila.cli.host import add_draft_flag, add_threads_flag
from kafila.engine import DTYPE_CHOICES, PREFILL_CHUNK, QUANT_CHOICES

if TYPE_CHECKING:
    from kafila.engine.backend import Backend
    from kafila.engine.system import MemoryBudget

# kafila.engine.sampler's settings, as the API takes them per request: (flag, type, default, help)
SAMPLING_FLAGS: list[tuple[str, type, float | int | None, str]] = [
    ("--temperature", float, 0.0, "sampling temperature; 0 = greedy (the default)"),
    ("--top-k", int, 0, "sample among the K most likely tokens; 0 = all"),
    ("--top-p", float, 1.0, "sample among the most likely tokens holding P of the mass"),
    (
        "--min-p",
        float,
        0.0,
        "sample only among tokens at least P times as likely as the most likely one (default 0: off)",
    ),
    ("--seed", int, None, "seed of the sampler (repeatable sampling)"),
    (
        "--repeat-penalty",
        float,
        1.0,
        "divide (multiply, where negative) the logits of the last --repeat-last-n tokens of prompt and "
        "answer by this; > 1 discourages repeating (Ollama's repeat_penalty; default 1: off)",
    ),
    ("--repeat-last-n", int, 64, "tokens --repeat-penalty looks back over (default 64)"),
    (
        "--presence-penalty",
        float,
        0.0,
        "subtract this from the logit of every token the answer already holds, -2 to 2 (OpenAI's)",
    ),
    (
        "--frequency-penalty",
        float,
        0.0,
        "subtract this times how often the answer holds a token from its logit, -2 to 2 (OpenAI's)",
    ),
]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prompt",
        metavar="PROMPT",
        nargs="?",
        help="the user's message (or the text to continue, with --raw); '-' or none with a pipe: read "
        "it from standard input (`echo Hi | kafila run`), its trailing line breaks left out",
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a default model name (smollm2-135m, converted on first use) or the path of a Hugging Face "
        "folder (config.json + safetensors + tokenizer.json), a .gguf file (Llama, Qwen3) or a model of "
        "the Ollama store (ollama:NAME[:TAG]); see `kafila models`",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "torch", "mlx"],
        help="array library: auto = MLX on Apple Silicon, torch on CUDA when present, else torch on the CPU; "
        "mlx also runs on Linux through mlx[cpu]",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="compute and KV-cache dtype: auto = the checkpoint's own (fp32 for the default model, "
        "bf16 for a bf16 checkpoint), as a session's",
    )
    parser.add_argument(
        "--quant",
        default="auto",
        choices=QUANT_CHOICES,
        help="weight format: int8 (8-bit, groups of 32) or q4 (4-bit with scale and minimum per group of "
        "32; the default model is then served from its GGUF's own blocks); none = floats; auto = the "
        "checkpoint's own (docs/weights.md)",
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="stop after this many generated tokens")
    parser.add_argument(
        "--weights-from",
        metavar="URL",
        help="a --model this machine does not hold: fetch it first from this HTTP(S) mirror (URL/<file> "
        "answers each file) or Hugging Face hub model (https://huggingface.co/ORG/REPO) into the cache's "
        "models folder under the --model name, once (a token in HF_TOKEN goes to the hub)",
    )
    for flag, kind, default, text in SAMPLING_FLAGS:
        parser.add_argument(flag, type=kind, default=default, help=text)
    add_threads_flag(parser)
    parser.add_argument(
        "--context",
        type=positive_int,
        default=2048,
        help="positions reserved in the KV cache (prompt + answer); a longer prompt is refused",
    )
    parser.add_argument(
        "--raw", action="store_true", help="plain completion of PROMPT, without the model's chat template"
    )
    parser.add_argument("--system", default=None, help="a system message placed before PROMPT (chat mode)")
    add_draft_flag(parser)
    parser.add_argument(
        "--chunk",
        type=positive_int,
        default=PREFILL_CHUNK,
        help=f"prompt tokens per prefill step (default {PREFILL_CHUNK}, as in `kafila host`: the same "
        "value gives the same tokens as a session)",
    )


def main(args: argparse.Namespace) -> int:
    from kafila.engine.backend import BackendError
    from kafila.engine.sampler import SamplingParams
    from kafila.engine.stage import StageError
    from kafila.engine.tokenizer import TokenizerError
    from kafila.models.checkpoint import CheckpointError
    from kafila.models.registry import ModelNotFound
    from kafila.session.weights.manifest import WeightsError

    try:
        params = SamplingParams(
            args.temperature, args.top_k, args.top_p, args.seed, args.max_tokens,
            repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            min_p=args.min_p,
        )  # fmt: skip
        args.prompt = read_prompt(args.prompt, sys.stdin)
        return _run(args, params)
    except (
        ValueError, BackendError, StageError, TokenizerError, CheckpointError, ModelNotFound, WeightsError
    ) as exc:  # fmt: skip
        print(f"kafila run: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, params) -> int:  # type: ignore[no-untyped-def]
    from kafila.engine.backend import checkpoint_dtype
    from kafila.engine.backend import resolve as resolve_backend
    from kafila.engine.draft import draft_model_of, policy_for
    from kafila.engine.draft_model import load_draft_model
    from kafila.engine.generate import Timings, generate
    from kafila.engine.stage import Stage
    from kafila.engine.tokenizer import Tokenizer
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.registry import resolve
    from kafila.session.weights.mirror import fetch_checkpoint, needs_fetching

    if args.weights_from is not None and needs_fetching(args.model):
        import asyncio

        from kafila.models.cache import models_dir

        asyncio.run(fetch_checkpoint(args.weights_from, models_dir() / args.model))
    ckpt = Checkpoint.open(resolve(args.model, quant=args.quant), complete=True)
    ckpt.config.check_context(args.context, args.model)
    tok = Tokenizer.from_checkpoint(ckpt)
    prompt = _prompt_ids(tok, args)
    be = resolve_backend(args.backend, checkpoint_dtype(args.dtype, ckpt.stored_dtype))
    refuse_unless_fits(ckpt, be, args)
    stage = Stage.load(ckpt, range(ckpt.n_blocks), True, backend=be, context=args.context, quant=args.quant)
    warm_up(stage, prompt)
    timings, stream = Timings(), tok.stream()
    draft, draft_model = policy_for(args.draft), draft_model_of(args.draft)
    drafter = None if draft_model is None else load_draft_model(draft_model, stage)
    eos = tuple(tok.stop_ids)
    steps = generate(
        stage, prompt, params, eos_ids=eos, chunk=args.chunk, timings=timings, draft=draft, drafter=drafter
    )
    for token in steps:
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
    weights = getattr(stage.model, "quant", "none")
    backend = str(stage.backend) + ("" if weights == "none" else f", {weights} weights")
    print(_summary(timings, backend, _length_limit(args, len(prompt))), file=sys.stderr)
    return 0


def refuse_unless_fits(ckpt, be, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    """Raise ValueError before any weight is read when the whole model, with its KV cache at
    --context, needs more than this process may take: the planner's numbers and the bound's source."""
    from kafila.engine import DTYPES
    from kafila.engine.stage import resolve_quant
    from kafila.planner.cost import Workload, fmt_bytes, shortfall

    w_fmt = resolve_quant(args.quant, ckpt.stored_format)
    manifest = ckpt.manifest(DTYPES[be.dtype], w_fmt)
    budget = device_budget(be)
    if budget is None:
        return
    w = Workload.of(manifest, args.context, 1)
    short = shortfall("this machine", budget.usable, w, ckpt.n_blocks, head=True)
    if short is None:
        return
    smaller = "a shorter --context, " + ("" if w_fmt == "q4" else "--quant q4, ")
    raise ValueError(
        f"{args.model} does not fit: {short}; that is {fmt_bytes(budget.available)} available "
        f"({budget.source}) less {fmt_bytes(budget.kept)} kept for the system; try {smaller}or a session "
        "across machines (`kafila host`, then `kafila join` on the others)"
    )


def device_budget(be: Backend) -> MemoryBudget | None:
    """The memory a stage on `be` may take: a CUDA card's free memory, else this process's RAM budget."""
    from kafila.engine import system

    if be.device == "cuda":
        import torch

        return system.MemoryBudget(int(torch.cuda.mem_get_info()[0]), "the CUDA card's free memory")
    return system.memory_budget()


def warm_up(stage, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    """One throwaway forward pass of the prompt's first two tokens, so that the timed prefill is
    warm: the process's first pass loads the compiled kernels and touches every weight page (it
    measured 128-165 tok/s on the default model where a warm prefill runs 570-730)."""
    stage.open("warm-up")
    try:
        [h] = stage.forward([("warm-up", 0, stage.embed(prompt[:2]))])
        stage.logits(h[-1])
    finally:
        stage.close("warm-up")


def read_prompt(given: str | None, stdin: TextIO) -> str:
    """PROMPT as typed, or standard input's text for '-' (or for no PROMPT where stdin is not a
    terminal), without its trailing line breaks (`echo` adds one the model would continue after)."""
    if given is not None and given != "-":
        return given
    if given is None and stdin.isatty():
        raise ValueError("give a PROMPT, or '-' to read it from standard input (`echo Hi | kafila run`)")
    return stdin.read().rstrip("\r\n")


def _length_limit(args: argparse.Namespace, prompt_tokens: int) -> str:
    """What a "length" stop ran into: --max-tokens, or the context the prompt left room in."""
    if prompt_tokens + args.max_tokens <= args.context:
        return f"--max-tokens {args.max_tokens}"
    return f"--context {args.context} full ({prompt_tokens} prompt tokens)"


def _prompt_ids(tok, args: argparse.Namespace) -> list[int]:  # type: ignore[no-untyped-def]
    if args.system is not None and (args.raw or tok.chat_template is None):
        why = "with --raw" if args.raw else f"{args.model} has no chat template"
        raise ValueError(f"--system has no place {why}: the prompt is plain text")
    if not args.raw and tok.chat_template is None:
        note = f"kafila run: {args.model} has no chat template: the prompt goes as plain text"
        print(note, file=sys.stderr)
    if args.raw or tok.chat_template is None:
        return tok.encode(args.prompt)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    return tok.encode_chat(messages, add_generation_prompt=True)


def _summary(t, backend: str, limit: str) -> str:  # type: ignore[no-untyped-def]
    stop = f"length ({limit})" if t.stop_reason == "length" else t.stop_reason
    return (
        f"prefill: {t.prompt_tokens} tokens in {t.prefill_s:.2f} s ({t.prefill_tps:.1f} tok/s, warm); "
        f"decode: {max(t.generated_tokens - 1, 0)} tokens in {t.decode_s:.2f} s ({t.decode_tps:.1f} tok/s)"
        f"{_drafts(t)}; {backend}; stop: {stop}"
    )


def _drafts(t) -> str:  # type: ignore[no-untyped-def]
    """How many steps the decode took and the drafted tokens they kept, where it drafted."""
    if not t.drafted:
        return ""
    return f" in {t.steps} steps, {t.accepted} of {t.drafted} drafted tokens kept"
