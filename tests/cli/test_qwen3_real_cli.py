"""`kafila run` and `kafila plan` on a Qwen3 folder at the real widths, vocabulary, tokenizer and
chat template (tests.qwen3_real): run, a real subprocess, prints the text of transformers' greedy
tokens for the chat prompt; plan divides the folder's blocks over a small fleet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kafila.cli import main
from kafila.engine.tokenizer import Tokenizer
from kafila.models.checkpoint import Checkpoint
from tests.qwen3_real import LONG, SHORT, QwenReal

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("which", ["short", "long"])
def test_run_prints_the_text_of_transformers_greedy_tokens(qwen3_real: QwenReal, which: str) -> None:
    want, messages = (qwen3_real.short, SHORT) if which == "short" else (qwen3_real.long, LONG)
    system = [m["content"] for m in messages if m["role"] == "system"]
    argv = ["--model", str(qwen3_real.folder), "--dtype", "fp32", "--context", "512", "--chunk", "64"]
    argv += ["--max-tokens", str(len(want.tokens)), *(["--system", system[0]] if system else [])]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "kafila", "run", *argv, messages[-1]["content"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer.from_checkpoint(Checkpoint.open(qwen3_real.folder))
    assert proc.stdout == tok.decode(want.tokens, skip_special_tokens=True) + "\n"


FLEET = """
[session]
model = "qwen3-8b"
context = 4096
concurrency = 2

[[device]]
name = "desk"
memory_gb = 8
bandwidth_gb_s = 100
overhead_us = 50
tflops = 10
nat = "ordinary"
rtt_ms = 10

[[device]]
name = "laptop"
memory_gb = 4
bandwidth_gb_s = 60
overhead_us = 80
tflops = 5
nat = "ordinary"
rtt_ms = 12

[[device]]
name = "mini"
memory_gb = 4
bandwidth_gb_s = 80
overhead_us = 60
tflops = 4
nat = "ordinary"
rtt_ms = 11
"""


def test_plan_divides_the_folders_blocks_over_a_fleet(qwen3_real: QwenReal, tmp_path, capsys) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    assert main(["plan", str(fleet), "--model", str(qwen3_real.folder), "--division", "kafila"]) == 0
    out = capsys.readouterr().out
    assert f"{qwen3_real.folder} (4 blocks), context 4096 x concurrency 2" in out
    table = out.split("blocks per device (stage ms), in ring order from the head:")[1].splitlines()[2:]
    counts = {row.split()[0]: int(row.split()[1]) for row in table if row.strip()}
    assert set(counts) == {"desk", "laptop", "mini"} and sum(counts.values()) == 4, out
