"""`kafila` command line: one module per subcommand under kafila/cli/.

Each subcommand module defines `configure(parser)` (flags only, no heavy imports at module
level) and `main(args) -> int`. The table below is the whole dispatch; modules are imported
only when their command runs or when help is printed. The imports inside the commands' functions
are there for start-up time (`kafila --help` must not load torch or aioquic), not to dodge import
cycles: tests/test_package_graph.py checks that there are none.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from kafila import __version__

# name -> (module under kafila.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "generate text with a model on this machine"),
    "models": ("models", "list the models available here"),
    "probe": ("probe", "measure this device (bandwidth, overhead, memory, throughput)"),
    "plan": ("plan", "plan a fleet from a TOML file and compare divisions"),
    "rendezvous": ("rendezvous", "run the rendezvous service"),
    "host": ("host", "open a session for a model and serve as a member"),
    "join": ("join", "join a session with its code"),
    "demo": ("demo", "a rendezvous and members (three by default) on this machine"),
    "trace": ("trace", "read session traces"),
}
SERVING = frozenset({"rendezvous", "host", "join", "demo"})  # start with the descriptor limit raised


ENVIRONMENT = """environment:
  KAFILA_LOG=console|json     how log lines on stderr look (default console; the rendezvous: json)
  KAFILA_LOG_LEVEL=LEVEL      debug, info (default), warning or error; warning leaves only the
                              progress lines ("kafila: ...") and what went wrong
  KAFILA_CACHE=DIR            models and fetched weights (default $XDG_CACHE_HOME/kafila, else
                              ~/.cache/kafila)"""


def _load(name: str):  # type: ignore[no-untyped-def]
    return importlib.import_module(f"kafila.cli.{COMMANDS[name][0]}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter  # keeps the environment table's lines
    parser = argparse.ArgumentParser(
        prog="kafila",
        description="Kafila: one model server from trusted machines.",
        epilog=ENVIRONMENT,
        formatter_class=raw,
    )
    parser.add_argument("--version", action="version", version=f"kafila {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        cmd = sub.add_parser(
            name, help=help_text, description=help_text, epilog=ENVIRONMENT, formatter_class=raw
        )
        if only is None or only == name:
            try:
                _load(name).configure(cmd)
            except ModuleNotFoundError as exc:
                if exc.name != f"kafila.cli.{COMMANDS[name][0]}":
                    raise
                cmd.description = f"{help_text} (not available in this build)"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv_is_ours = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the command's own parser, whose usage shows the flags it takes
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "threads", None):  # before any backend loads: OpenMP and numba read it once
        from kafila.engine.system import THREADS_ENV

        os.environ[THREADS_ENV] = str(args.threads)
    from kafila.obs.log import configure_logging

    try:
        configure_logging()
    except ValueError as exc:
        parser.error(str(exc))
    if args.command in SERVING:
        from kafila.cli.descriptors import raise_descriptor_limit

        raise_descriptor_limit()
    try:
        rc = int(_load(args.command).main(args) or 0)
    except KeyboardInterrupt:
        rc = 130
    if argv_is_ours and _off_loop_busy():  # the program, not a caller in this process
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)  # a probe or stage load still in torch aborted the interpreter's exit (rc 134)
    return rc


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser that `args` came through last: `kafila trace summarize`'s, say."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                return _innermost(action.choices[chosen], args)
    return parser


def _off_loop_busy() -> bool:
    progress = sys.modules.get("kafila.session.progress")  # loaded only by commands that form sessions
    return progress is not None and bool(progress.off_loop_busy())


if __name__ == "__main__":
    raise SystemExit(main())
