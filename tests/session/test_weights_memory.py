"""A member's resident memory while it fetches and loads its shard, against the shard's bytes: the
fetch holds only the tensors in flight, the load about one copy of the stage (kafila.session.weights.fetch,
kafila.engine.stage). Measured in a child process (its own peak resident set, VmHWM, reset between
phases through /proc/self/clear_refs) at a shape whose shard (256 MB) dwarfs the interpreter's noise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kafila.models.checkpoint import Checkpoint
from kafila.session.weights.fetch import DEFAULT_WINDOW, SPOOL_BYTES, STORING
from kafila.session.weights.manifest import DEFAULT_MAX_REQUEST
from tests.tiny_models import make_tiny

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = range(0, 4)
SLACK = 32 << 20  # the interpreter's own allocations during a phase (measured: under 16 MB)

CHILD = r"""
import asyncio, json, re, sys, tempfile
from pathlib import Path
from kafila.engine.backend import resolve
resolve("torch", "fp32")  # the runtime a member has before its weights: torch, threads, numba kernels
from kafila.models.torch import decode_cpu
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from kafila.session.channel import MemoryChannel
from kafila.session.weights import fetch as fetching
from kafila.session.weights.fetch import fetch_shard
from kafila.session.weights.server import WeightServer

def status(key):
    return int(re.search(key + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

def reset():
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

folder, cache = Path(sys.argv[1]), Path(sys.argv[2])
a, b = int(sys.argv[3]), int(sys.argv[4])
fetching.SPOOL_BYTES = int(sys.argv[5])
out = {}

async def fetch():
    server = WeightServer(folder, cache=cache / "host")
    await server.prepare()
    member, host = MemoryChannel.pair("host", "m1")[::-1]
    serving = asyncio.ensure_future(server.serve(host, timeout=60))
    reset()
    out["before_fetch"] = status("VmRSS")
    shard = await fetch_shard(member, range(a, b), False, cache=cache / "m1", local=[], progress=False)
    out["fetch_peak"] = status("VmHWM")
    await serving
    return shard

shard = asyncio.run(fetch())
out["fetched"] = shard.tensor_bytes
reset()
out["before_load"] = status("VmRSS")
stage = Stage.load(Checkpoint.open(shard.path), range(a, b), False, "torch", "fp32", 256)
out["load_peak"] = status("VmHWM")
out["weights"], out["kv"] = stage.bytes_loaded, stage.kv_bytes
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    """Four fp32 blocks of hidden 1024 and MLP 4096: 64 MB a block, the largest tensor 16 MB."""
    folder = tmp_path_factory.mktemp("wide")
    make_tiny(
        folder,
        "llama",
        num_hidden_layers=len(BLOCKS),
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=4096,
        tie_word_embeddings=True,
    )
    return folder


@pytest.mark.parametrize("spool", [SPOOL_BYTES, 1 << 62], ids=["default", "assembled-in-memory"])
def test_fetching_a_shard_holds_the_tensors_in_flight_and_loading_it_about_one_copy(
    wide, tmp_path, spool
) -> None:
    """By default each tensor of SPOOL_BYTES (8 MiB) or more goes to its blob's file as it arrives,
    so only smaller ones are ever whole in memory; `assembled-in-memory` keeps every tensor in
    memory until it is stored (the smaller tensors' path, here for all of them)."""
    ckpt = Checkpoint.open(wide)
    names = ckpt.names_for(BLOCKS, False)
    shard = sum(ckpt.tensors[n].nbytes for n in names)
    largest = max(ckpt.tensors[n].nbytes for n in names if ckpt.tensors[n].nbytes < spool)
    args = [str(wide), str(tmp_path), str(BLOCKS.start), str(BLOCKS.stop), str(spool)]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["fetched"] == shard == got["weights"]
    # a window of requests spans at most two tensors being assembled; STORING + 1 whole ones are
    # checked and written at most (the next response waits)
    fetch_bound = (STORING + 3) * largest + DEFAULT_WINDOW * DEFAULT_MAX_REQUEST + SLACK
    fetch_grew = got["fetch_peak"] - got["before_fetch"]
    assert fetch_grew <= fetch_bound, (
        f"fetching a {shard / 1e6:.0f} MB shard (largest tensor {largest / 1e6:.0f} MB) grew the resident "
        f"set by {fetch_grew / 1e6:.0f} MB; bound {fetch_bound / 1e6:.0f} MB"
    )
    load_bound = 1.15 * (shard + got["kv"]) + SLACK
    load_grew = got["load_peak"] - got["before_load"]
    assert load_grew <= load_bound, (
        f"loading a {shard / 1e6:.0f} MB shard + {got['kv'] / 1e6:.0f} MB KV grew the resident set by "
        f"{load_grew / 1e6:.0f} MB ({load_grew / (shard + got['kv']):.2f}x); bound {load_bound / 1e6:.0f} MB"
    )
