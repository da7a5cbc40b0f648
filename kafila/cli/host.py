"""`kafila host`: open a session for a model, print its code, and serve as a member."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kafila.api.security import add_api_security_flags, security_from_args
from kafila.cli.apiflags import add_api_limit_flags, limits_from_args
from kafila.cli.argtypes import (
    count,
    member_name,
    non_negative_int,
    positive_int,
    positive_number,
    rendezvous_url,
)
from kafila.cli.rendezvous import metrics_address
from kafila.engine import DTYPE_CHOICES, PREFILL_CHUNK, QUANT_CHOICES
from kafila.proto.signaling import DEFAULT_PORT, SIGNAL_PATH
from kafila.session.terms import DEFAULT_PROBE_MAX_AGE_S, DEFAULT_QUEUE, DEFAULT_RENDEZVOUS

if TYPE_CHECKING:  # the runtime loads the engine: only the commands that form a session import it
    from kafila.session.runtime import MemberRuntime


def add_member_flags(parser: argparse.ArgumentParser) -> None:
    """Flags every member has (host and join)."""
    add_api_security_flags(parser)
    add_api_limit_flags(parser)
    parser.add_argument(
        "--rendezvous",
        type=rendezvous_url,
        default=DEFAULT_RENDEZVOUS,
        help="the rendezvous: its signaling URL (ws:// or wss://; http:// and https:// mean the "
        f"same), or HOST[:PORT] for ws://HOST:PORT{SIGNAL_PATH} (port {DEFAULT_PORT} if not given); "
        f"default {DEFAULT_RENDEZVOUS}",
    )
    parser.add_argument(
        "--api",
        default="127.0.0.1:11434",
        help="this member's OpenAI/Ollama API address HOST:PORT (default 127.0.0.1:11434, localhost only); "
        "'off' serves no API",
    )
    parser.add_argument(
        "--metrics",
        type=metrics_address,
        metavar="HOST:PORT",
        help="also serve /metrics on a listener of its own, up from the start (while forming, and while "
        "the ring is broken) and independent of --api (e.g. 0.0.0.0:9464 for a Prometheus elsewhere, "
        "with the API kept on localhost) (default: /metrics on the API's address only)",
    )
    parser.add_argument(
        "--name",
        type=member_name,
        help="this member's name in the session (default: this machine's host name; a joining member "
        "adds its member id, as laptop-2)",
    )
    parser.add_argument(
        "--backend", default="auto", choices=["auto", "torch", "mlx"], help="array library (default auto)"
    )
    parser.add_argument(
        "--memory-gb",
        type=positive_number,
        help="offer at most this much memory (GB) for weights and KV cache (default: the probe's figure; "
        "more than that offers the probe's figure)",
    )
    parser.add_argument("--trace", help="append trace records (JSON lines) to this file")
    parser.add_argument(
        "--lost-after",
        "--dead-after",
        dest="dead_after",
        type=_lost_after,
        default=3.0,
        metavar="SECONDS",
        help="a ring neighbour that sends nothing (not even its beats, every SECONDS/6) for this long "
        "counts as lost: the ring breaks naming it and its cause (default 3; at least 2, as a link whose "
        "direct path fails takes up to 1.25 s to move to the relay, which must not count as a loss). "
        "The rendezvous's notice that a member left or disconnected breaks it sooner. --dead-after is "
        "the same flag's old name",
    )
    parser.add_argument(
        "--weights-from",
        metavar="URL",
        help="fetch checkpoint ranges from this HTTP(S) mirror (URL/<file> answers each file, with "
        "Range) or Hugging Face hub model (https://huggingface.co/ORG/REPO, or .../resolve/REVISION) "
        "before asking the host; every range is checked against the host's digests. A token in HF_TOKEN "
        "goes to the hub. On the host: every member uses it unless it names its own (default: members "
        "that hold ranges, then the host)",
    )
    parser.add_argument(
        "--replica-bytes",
        type=_gigabytes,
        default=16.0,
        metavar="GB",
        help="keep at most this much (GB) of the next ring member's shard on disk, fetched after this "
        "member's own and served to others by range, so every block is on two members' disks "
        "(default 16; 0 keeps none)",
    )
    add_threads_flag(parser)
    parser.add_argument(
        "--emulate-speed",
        type=_speed,
        default=1.0,
        metavar="S",
        help="emulate a device S times as fast as this one (0 < S <= 1): every computation of the "
        "model, in the probe and in the ring, is followed by idle time so it takes 1/S as long. "
        "For fleets of several members on one machine (benchmarks, demo); default 1 (off)",
    )
    parser.add_argument(
        "--probe-max-age",
        type=_seconds,
        default=DEFAULT_PROBE_MAX_AGE_S,
        metavar="S",
        help="offer this machine's own measurement of at most S seconds ago, made under the same terms "
        "(model, formats, pace, CPUs, quota, version) and kept in the weight cache's folder, instead of "
        f"measuring again; memory is read again regardless (default {DEFAULT_PROBE_MAX_AGE_S:g}; "
        "0 measures every time)",
    )
    add_draft_flag(parser, "; as the ring's head (the host, or a member the head moved to)")
    parser.add_argument(
        "--draft-ahead",
        default=0,
        type=non_negative_int,
        metavar="N",
        help="as the ring's head, while a drafted step is in the ring, send up to N more steps for the "
        "positions after it, assuming its draft is kept and guessing the token it samples (the "
        "answer is unchanged: a step whose assumption fails is dropped and its positions written "
        "over); default 0: off, as measured it did not pay on every kind of prompt (docs/engine.md)",
    )


def _seconds(text: str) -> float:
    return _non_negative(text, "a number of seconds")


def add_draft_flag(parser: argparse.ArgumentParser, where: str = "") -> None:
    from kafila.engine.draft import DRAFT_HELP

    parser.add_argument(
        "--draft", default="lookup", type=_draft, metavar="{none,lookup,MODEL}", help=DRAFT_HELP + where
    )


def _draft(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("--draft needs none, lookup or a model's name or folder")
    return text


def _gigabytes(text: str) -> float:
    return _non_negative(text, "a size in GB")


def _non_negative(text: str, what: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text} is not {what} (0 or more)")
    return value


def _lost_after(text: str) -> float:
    from kafila.session.channel import lost_after_problem

    seconds = positive_number(text)
    if problem := lost_after_problem(seconds):
        raise argparse.ArgumentTypeError(problem)
    return seconds


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--threads",
        type=positive_int,
        help="compute with at most this many CPU threads (default: every CPU this process may use, "
        "capped by a cgroup CPU quota)",
    )


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    """--model of a command that serves one (`kafila host`, `kafila demo`)."""
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="model to serve: a name, a Hugging Face folder, a .gguf file or ollama:NAME[:TAG] "
        "(default smollm2-135m)",
    )


def add_division_flag(parser: argparse.ArgumentParser) -> None:
    """--division of a command that forms a session (`kafila host`, `kafila demo`)."""
    from kafila.planner.decide import DIVISIONS  # pure: the standard library only

    parser.add_argument(
        "--division",
        default=DIVISIONS[0],
        choices=DIVISIONS,
        help="how the model's blocks are divided among the members: kafila (default: by the cost model "
        "the members' probes measure, so slower members get fewer blocks), uniform (equal counts) or "
        "memory (in proportion to each member's memory)",
    )


def add_objective_flag(parser: argparse.ArgumentParser) -> None:
    from kafila.planner.decide import OBJECTIVES  # pure: the standard library only

    parser.add_argument(
        "--objective",
        default=OBJECTIVES[0],
        choices=OBJECTIVES,
        help="what the kafila division minimizes: load (default: the time per token at the declared "
        "concurrency, max(slowest stage, circuit / concurrency)) or bottleneck (the slowest stage "
        "alone, as the paper's Algorithm 1)",
    )


def _speed(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_flag(parser)
    parser.add_argument(
        "--members",
        type=positive_int,
        default=1,
        help="members in the session, this host included (default 1)",
    )
    parser.add_argument(
        "--context",
        type=count,
        default=2048,
        help="declared context: prompt plus answer tokens, at most the model's trained positions "
        "(default 2048)",
    )
    parser.add_argument(
        "--concurrency",
        type=count,
        default=1,
        help="requests served at once (more wait in a queue); the kafila division is planned for "
        "this load (default 1: the shortest circuit for one user)",
    )
    parser.add_argument(
        "--queue",
        type=non_negative_int,
        default=DEFAULT_QUEUE,
        help="requests that may wait for a slot, at every member's API together; more are refused "
        f"with 429 busy (default {DEFAULT_QUEUE}; 0: none waits)",
    )
    add_division_flag(parser)
    add_objective_flag(parser)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="the session's dtype, which every member computes in (default auto: the checkpoint's "
        "own, fp32 for the default model)",
    )
    parser.add_argument(
        "--quant",
        default="auto",
        choices=QUANT_CHOICES,
        help="the session's weight format, which every member loads and is priced in: int8 (8-bit, "
        "groups of 32), q4 (4-bit with scale and minimum per group of 32; the default model is then "
        "served from its GGUF's own blocks) or none (floats); members fetch the packed bytes "
        "(default auto: the checkpoint's own, floats for the default model; docs/engine-quant.md)",
    )
    parser.add_argument(
        "--chunk",
        type=positive_int,
        default=PREFILL_CHUNK,
        help=f"prompt tokens per prefill step (default {PREFILL_CHUNK}, as in `kafila run`)",
    )
    parser.add_argument(
        "--wait",
        type=positive_number,
        default=300.0,
        help="seconds to wait for every member's report, and again (once the plan is sent and the "
        "weights served) for every member to become ready (default 300)",
    )
    parser.add_argument("--code-file", help="also write the session code to this file (for scripts)")
    add_member_flags(parser)


def options(args: argparse.Namespace) -> object:
    """The member's Options from its flags; ValueError (one line) for flags that cannot work here."""
    from pathlib import Path

    from kafila.session.terms import Options

    o = Options(
        rendezvous=args.rendezvous,
        name=args.name,
        api=None if args.api == "off" else args.api,
        api_security=security_from_args(args),
        api_limits=limits_from_args(args),
        metrics=args.metrics,
        backend=args.backend,
        memory_bytes=int(args.memory_gb * 1e9) if args.memory_gb is not None else None,
        trace=Path(args.trace) if args.trace else None,
        dead_after=args.dead_after,
        emulate_speed=args.emulate_speed,
        weights_from=args.weights_from,
        replica_bytes=int(args.replica_bytes * 1e9),
        draft=args.draft,
        draft_ahead=args.draft_ahead,
        probe_max_age_s=args.probe_max_age,
    )
    for key in (
        "model",
        "members",
        "context",
        "concurrency",
        "division",
        "objective",
        "dtype",
        "quant",
        "chunk",
        "queue",
    ):
        if hasattr(args, key):
            setattr(o, key, getattr(args, key))
    if hasattr(args, "wait"):
        o.wait_s = args.wait
    o.check()
    return o


async def serve_until_interrupted(formed: MemberRuntime) -> None:
    """Serve until cancelled (Ctrl-C, SIGTERM), or until the host ends the session (a member's
    `formed.ended`), then close this member's part."""
    import asyncio

    from kafila.session.progress import say

    try:
        if formed.ended is None:
            await asyncio.Event().wait()
        else:
            say(await asyncio.shield(formed.ended))  # a Ctrl-C must not settle it (as cancelled)
    finally:
        await formed.close()


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kafila.session.errors import SessionError
    from kafila.session.forming.host import host
    from kafila.session.progress import say
    from kafila.session.weights.cache import write_atomic

    def on_code(code: object) -> None:
        if args.code_file:
            try:
                write_atomic(Path(args.code_file), [f"{code}\n".encode()])  # whole or not at all
            except OSError as exc:
                why = exc.strerror or exc
                raise SessionError(f"cannot write --code-file {args.code_file}: {why}") from exc

    problem = args.code_file and code_file_problem(args.code_file)
    if problem:  # named now, not once the session is open (and nothing is created before the code)
        say(f"error: cannot write --code-file {args.code_file}: {problem}")
        return 1
    return run_member(lambda: host(options(args), on_code))  # type: ignore[arg-type]


def code_file_problem(path: str) -> str | None:
    """Why `path` could not take the session code (None if it can), without creating it: a script
    that waits for the file to appear must see it only with the code in it."""
    import os
    from pathlib import Path

    file = Path(path)
    folder = file.parent
    if file.is_dir():
        return "Is a directory"
    if not folder.is_dir():
        return f"No such file or directory (no folder {folder})"
    if not os.access(folder, os.W_OK) or (file.exists() and not os.access(file, os.W_OK)):
        return "Permission denied"
    return None


def member_failures() -> tuple[type[Exception], ...]:
    """What a member's start or serving can end in that names its own cause, so one line says it:
    the session refused or not formed, a bad model, checkpoint or code (ValueError), the rendezvous
    refusing or gone, a link that could not be made or broke, the weight fetch, the NAT probe."""
    from kafila.net.errors import LinkError, NatProbeError
    from kafila.net.signaling import SignalingError
    from kafila.session.channel import ChannelError
    from kafila.session.errors import SessionError
    from kafila.session.weights.manifest import WeightsError

    return (SessionError, ValueError, SignalingError, LinkError, ChannelError, WeightsError, NatProbeError)


def run_member(start: Callable[[], Awaitable[Any]]) -> int:
    """Form the session with `start`, serve until Ctrl-C or SIGTERM (`kill`, `docker stop`): either
    closes the links and the API before the process ends (exit 130 or 143). A joining member also
    ends when the host ends the session (exit 0). SIGUSR1 (`docker kill -s USR1`, `systemctl kill
    -s USR1`, `launchctl kill SIGUSR1`) makes the member that coordinates the session (the host, or
    the member that took its role over) hand that role over to the first present member of its
    succession order and leave, the session going on (exit 0); on any other member it is SIGTERM.
    A failure is one line naming it, exit 1."""
    import asyncio
    import signal

    from kafila.session.progress import say

    formed = False

    async def run() -> None:
        nonlocal formed
        task = asyncio.current_task()
        assert task is not None
        session: MemberRuntime | None = None

        def terminate() -> None:
            # once: the API's uvicorn catches the same SIGTERM and raises it again after stopping,
            # and a second cancel would cut the session's close short
            if not task.cancelling():
                task.cancel()

        def hand_over() -> None:
            """SIGUSR1: the member that coordinates hands its role over and leaves (exit 0); any
            other member, or one still forming, leaves as on SIGTERM."""
            if session is None or session.hand_over is None or session.name != session.host:
                terminate()
            elif session.handed_to is None:
                session.spawn(session.hand_over(), "hand_over")

        with contextlib.suppress(NotImplementedError):  # no loop signal handlers on Windows
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGTERM, terminate)
            loop.add_signal_handler(signal.SIGUSR1, hand_over)
        session = await start()
        formed = True
        await serve_until_interrupted(session)

    def closed() -> str:
        return "session closed" if formed else "left before the session formed"

    try:
        asyncio.run(run())
    except member_failures() as exc:
        say(f"error: {exc}")
        return 1
    except asyncio.CancelledError:  # SIGTERM: the session is closed (serve_until_interrupted)
        say(f"terminated: {closed()}")
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:  # Ctrl-C: closed the same way
        say(f"interrupted: {closed()}")
        return 128 + signal.SIGINT
    return 0
