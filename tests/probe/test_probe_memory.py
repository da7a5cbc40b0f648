"""The probe's synthetic weights do not stay resident after it (kafila.engine.heap): measured in a
child process at a shape whose blocks are tens of MB (glibc keeps freed arrays of that size in its
heaps unless they are trimmed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLACK = 32 << 20  # the interpreter's own allocations during the probe

CHILD = r"""
import json, re
from pathlib import Path
from kafila.engine.backend import resolve
from kafila.models.config import ModelConfig
from kafila.probe.measure import probe

def status(key):
    return int(re.search(key + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

resolve("torch", "fp32")
from kafila.models.torch import decode_cpu  # the runtime a member has anyway: its kernels
decode_cpu.warm_up()
config = dict(model_type="qwen3", hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=65536,
              tie_word_embeddings=False, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6)
Path("/proc/self/clear_refs").write_text("5")
base = status("VmRSS")
probe("torch", "fp32", repeats=1, model=ModelConfig.from_dict(config), quant="q4", stream_bytes=64 << 20)
print(json.dumps({"base": base, "peak": status("VmHWM"), "after": status("VmRSS")}))
"""


def test_what_the_probe_allocated_is_returned_to_the_system_after_it() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    used, kept = got["peak"] - got["base"], got["after"] - got["base"]
    assert used > 4 * SLACK, f"the probe used only {used / 1e6:.0f} MB: too little to tell"
    assert kept <= 0.1 * used + SLACK, (
        f"after the probe {kept / 1e6:.0f} MB of its {used / 1e6:.0f} MB peak stayed resident"
    )
