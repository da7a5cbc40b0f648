"""`kafila demo`: a rendezvous and one member per CPU share on this machine, unequal on purpose."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kafila.cli.argtypes import positive_int
from kafila.cli.host import add_division_flag, add_model_flag

if TYPE_CHECKING:
    from kafila.demo.fleet import FleetError

PROMPT = "What is the capital of France? Answer in one sentence."
CONTEXT = 512  # the demo session's context: prompt plus answer tokens
MAX_MEMBERS = 8  # one per name in kafila.demo.fleet.DEFAULT_NAMES
MIN_SHARE = 0.01  # a hundredth of one CPU; slower members would outlast the fleet's wait to start
WORKDIR = "/tmp/kafila-demo"
DESCRIPTION = (
    f"a rendezvous and one member per --shares entry (three by default, at most {MAX_MEMBERS}) on "
    "this machine, each slowed to its CPU share; asks one of them a question, then serves until Ctrl-C"
)


class DemoError(Exception):
    """A failure the demo reports in one line (`kafila demo: error: ...`, exit 1)."""


def shares_list(text: str) -> tuple[float, ...]:
    """Comma-separated CPU shares, one per member: 1 to MAX_MEMBERS of them, each a fraction of one
    CPU from MIN_SHARE to 1 (argparse type)."""
    parts = text.split(",")
    if len(parts) > MAX_MEMBERS:
        raise argparse.ArgumentTypeError(
            f"{len(parts)} shares, one per member, but the demo runs at most {MAX_MEMBERS} members, "
            f"got {text!r}"
        )
    shares = []
    for part in parts:
        try:
            share = float(part)
        except ValueError:
            share = math.nan
        if not MIN_SHARE <= share <= 1:  # also refuses nan and inf
            raise argparse.ArgumentTypeError(
                f"each share must be a number from {MIN_SHARE} to 1 (a fraction of one CPU), "
                f"got {part.strip()!r} in {text!r}"
            )
        shares.append(share)
    return tuple(shares)


def answer_tokens(text: str) -> int:
    """A --max-tokens value: at least 1, and below the demo's context (the prompt needs room too)."""
    n = positive_int(text)
    if n >= CONTEXT:
        raise argparse.ArgumentTypeError(
            f"must be below the demo's context of {CONTEXT} tokens (prompt plus answer), got {text!r}"
        )
    return n


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    add_model_flag(parser)
    parser.add_argument(
        "--shares",
        type=shares_list,
        default=(1.0, 0.5, 0.25),
        metavar="S1,S2,...",
        help="CPU share of one core for each member, comma-separated, each from "
        f"{MIN_SHARE} to 1; their number is the number of members, 1 to {MAX_MEMBERS} (default "
        "1,0.5,0.25: three members); the first hosts",
    )
    parser.add_argument(
        "--slow-by",
        default="pace",
        choices=["pace", "quota"],
        help="how a share slows its member: pace (default) pins it to one CPU and stretches each "
        "computation to CPU time / share (--emulate-speed); quota uses a cgroup v1 cpu quota (root)",
    )
    add_division_flag(parser)
    parser.add_argument(
        "--prompt",
        default=PROMPT,
        help="the question, asked through a member that is not the head (the head itself when there "
        f"is one member); it and the answer share the demo's context of {CONTEXT} tokens",
    )
    parser.add_argument(
        "--max-tokens",
        type=answer_tokens,
        default=48,
        help=f"answer length limit, 1 to {CONTEXT - 1} (default 48)",
    )
    parser.add_argument(
        "--workdir",
        default=WORKDIR,
        help=f"the members' and the rendezvous's logs (NAME.log) and traces (NAME.trace.jsonl) go here "
        f"(default {WORKDIR}); each run first removes the previous run's logs and traces there, so "
        "they always belong to the latest run (other files are left alone)",
    )
    parser.add_argument(
        "--no-wait", action="store_true", help="stop after the answer instead of serving until Ctrl-C"
    )


def main(args: argparse.Namespace) -> int:
    from kafila.demo.fleet import FleetError

    try:
        return _demo(args)
    except DemoError as exc:
        print(f"kafila demo: error: {exc}", file=sys.stderr)
    except FleetError as exc:
        print(f"kafila demo: error: {fleet_error_line(exc)}", file=sys.stderr)
    return 1


def _demo(args: argparse.Namespace) -> int:
    import time

    import httpx

    from kafila.demo.fleet import LocalFleet

    shares: tuple[float, ...] = args.shares
    workdir = prepare_workdir(Path(args.workdir))
    check_model(args.model)
    fleet = LocalFleet(
        shares, args.model, args.division, context=CONTEXT, workdir=workdir, slow_by=args.slow_by
    )
    try:
        count = f"{len(shares)} member{'s' if len(shares) > 1 else ''}"
        print(f"starting a rendezvous and {count} (probe, plan, links, weight fetch) ...")
        fleet.start()
        print(fleet.describe())
        if fleet.shares_applied:
            how = "emulated pace" if args.slow_by == "pace" else "cgroup v1 cpu quota"
            print(f"members limited to {', '.join(f'{s:.0%}' for s in shares)} of one CPU ({how})")
        try:
            doc = fleet.session()
            print(f"\nring {' -> '.join(doc['ring'])} (head {doc['head']}), division {doc['division']}")
            print("predicted, this division next to uniform and memory-proportional:")
            print(fleet.predicted_table())
            member = fleet.not_head()
        except httpx.HTTPError as exc:
            fleet.check_alive()  # a member that exited is the cause: name it
            raise DemoError(f"cannot read the session from the host: {type(exc).__name__}: {exc}") from None
        print(f"\n{asking(member, str(doc['head']))}: {args.prompt}")
        question = [{"role": "user", "content": args.prompt}]
        body = {"model": str(doc.get("model") or args.model), "messages": question,
                "max_tokens": args.max_tokens, "temperature": 0, "stream": True}  # fmt: skip
        start = time.perf_counter()
        try:
            ask(member, fleet.url(member), body, sys.stdout)
        except DemoError:
            print()
            fleet.check_alive()
            raise
        print(f"\n({time.perf_counter() - start:.1f} s)")
        print("\nAPIs (OpenAI /v1, Ollama /api, /session, /traces, /metrics):")
        for name, url in fleet.api_urls.items():
            print(f"  {name}: {url}")
        print("traces (kafila trace summarize FILE):")
        for m in fleet.members:
            print(f"  {m.trace_path}")
        if not args.no_wait:
            print("serving until Ctrl-C")
            while True:
                fleet.check_alive()  # a member or the rendezvous that exits ends the demo, named
                time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.close()
    return 0


def prepare_workdir(workdir: Path) -> Path:
    """Create `workdir` if needed and remove the logs and traces an earlier run left there (members'
    traces are appended to, so runs would mix); DemoError naming --workdir when it cannot be used."""
    import tempfile

    from kafila.demo.fleet import DEFAULT_NAMES

    if workdir.exists() and not workdir.is_dir():
        raise DemoError(f"--workdir {str(workdir)!r} is not a folder")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        for name in (*DEFAULT_NAMES, "rendezvous"):
            for suffix in (".log", ".trace.jsonl"):
                (workdir / f"{name}{suffix}").unlink(missing_ok=True)
        with tempfile.TemporaryFile(dir=workdir):  # the logs and traces must be writable
            pass
    except OSError as exc:
        raise DemoError(f"--workdir {str(workdir)!r} cannot hold the demo's logs and traces: {exc}") from None
    return workdir


def check_model(model: str) -> None:
    """DemoError naming --model when it is neither a known model nor a model folder (before any
    process starts); the default model is converted here on first use."""
    from kafila.models.registry import resolve

    try:
        resolve(model)
    except ValueError as exc:  # ModelNotFound, DefaultModelUnavailable
        raise DemoError(f"--model {model!r}: {exc}") from None


def asking(member: str, head: str) -> str:
    """What the demo says before it asks `member` (the head itself only in a fleet of one)."""
    if member == head:
        return f"asking {member} (the head itself: the only member)"
    return f"asking {member} (not the head: it forwards to {head})"


def ask(member: str, url: str, body: dict[str, Any], out: IO[str]) -> None:
    """Stream the answer to POST `url`/v1/chat/completions into `out`; DemoError with the API's own
    message when it refuses the question or fails while answering, or when `url` cannot be reached."""
    import json

    import httpx

    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                r.read()
                raise DemoError(f"{member} refused the question ({r.status_code}): {_api_error(r.text)}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise DemoError(f"{member} failed while answering: {_api_error(line[6:])}")
                for choice in event.get("choices", ()):
                    print(choice.get("delta", {}).get("content") or "", end="", file=out, flush=True)
    except httpx.HTTPError as exc:
        raise DemoError(f"asking {member} at {url}: {type(exc).__name__}: {exc}") from None


def _api_error(text: str) -> str:
    """The message of an OpenAI-shaped error body, with a hint at the flags for the context."""
    import json

    try:
        error = json.loads(text)["error"]
        message, code = str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError):
        return text.strip()[:500] or "(no body)"
    if code == "context_length_exceeded":
        message += f" (the demo's context is {CONTEXT} tokens: shorten --prompt or lower --max-tokens)"
    return message


def fleet_error_line(exc: FleetError) -> str:
    """One line for a fleet failure: what failed, its log's last error line, and the log."""
    if exc.log is None:
        return exc.what
    cause = f": {exc.cause}" if exc.cause else ""
    return f"{exc.what}{cause} (its log: {exc.log})"
