"""Build the llama.cpp the benchmarks compare with (benchmarks/engine.py, benchmarks/ring_rpc.py), one
that starts on this CPU.

    python3 benchmarks/llama_build.py          # build/: llama-bench, llama-quantize, llama-perplexity
    python3 benchmarks/llama_build.py --rpc    # build-rpc/: ggml-rpc-server, llama-bench

From the llama-cpp-python 0.3.36 source distribution (its vendored llama.cpp), in
~/.cache/kafila/llama.cpp. First with -DGGML_NATIVE=ON (the compiler's -march=native, the fastest
build). A virtual CPU can list features its guest cannot run: on a 2-vCPU Xeon that lists AMX, a
native build died with SIGILL (at once, or only on the types AMX computes: Q8_0, Q4_K). So where
/proc/cpuinfo lists AMX the build is made without GGML_NATIVE, each x86 feature it lists switched
on (`portable_options`) and the AMX ones off; elsewhere natively first. The built llama-bench is
started (`start_failure`: one token on the default model's GGUF where there is one, else
--help); where it does not run, the next option set is built and started. The options of the build that
started are printed and written to <build>/kafila-options.txt.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

VERSION = "0.3.36"
CACHE = Path.home() / ".cache" / "kafila" / "llama.cpp"
BIN = CACHE / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp" / "build" / "bin"  # the default build's
NATIVE = ["-DGGML_NATIVE=ON"]
COMMON = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
# ggml's CMake option for each x86 feature as /proc/cpuinfo names it
X86_OPTIONS = {
    "avx": "GGML_AVX",
    "avx2": "GGML_AVX2",
    "avx_vnni": "GGML_AVX_VNNI",
    "bmi2": "GGML_BMI2",
    "fma": "GGML_FMA",
    "f16c": "GGML_F16C",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in /proc/cpuinfo's text (empty where it lists none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def portable_options(flags: set[str]) -> list[str]:
    """CMake options for a build without -march=native: each x86 feature in `flags` on, the others
    off, AMX always off (a guest may list it without being able to run it)."""
    options = ["-DGGML_NATIVE=OFF"]
    options += [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in X86_OPTIONS.items()]
    return options + [f"-D{opt}=OFF" for opt in AMX_OPTIONS]


def option_sets(flags: set[str]) -> list[list[str]]:
    """The option sets to try, in order: native first, else portable; portable alone where the CPU
    lists AMX, whose ggml kernels a guest may not run (a Xeon VM listing amx_tile built natively
    ran the default Q4_1 file, then died of SIGILL and SIGSEGV on Q8_0 and Q4_K_M files, whose
    products take the AMX path)."""
    portable = portable_options(flags)
    return [portable] if any(f.startswith("amx") for f in flags) else [NATIVE, portable]


def start_failure(cmd: Sequence[str], timeout: float = 300.0) -> str | None:
    """None where `cmd` runs and exits 0, else why not: killed by a signal (SIGILL: an instruction
    the CPU does not run), a non-zero exit with its error's end, no end within `timeout` seconds,
    or no program to run."""
    try:
        run = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{cmd[0]} did not end within {timeout:g} s"
    except OSError as exc:
        return f"{cmd[0]} cannot be run: {exc}"
    if run.returncode < 0:
        return f"{cmd[0]} was killed by {signal.Signals(-run.returncode).name}"
    if run.returncode > 0:
        return f"{cmd[0]} exited with {run.returncode}: {run.stderr.strip()[-300:]}"
    return None


def build_that_starts(
    make: Callable[[list[str]], Path], probe: Callable[[Path], list[str]], flags: set[str]
) -> tuple[list[str], Path]:
    """The first of the native and the portable option sets whose build starts: `make(options)`
    builds and returns the binary to start, `probe(binary)` the command that starts it. Returns
    (options, binary); RuntimeError with every failure where neither starts."""
    failures = []
    for options in option_sets(flags):
        binary = make(options)
        why = start_failure(probe(binary))
        if why is None:
            return options, binary
        print(f"[llama.cpp] built with {' '.join(options)}: {why}", file=sys.stderr)
        failures.append(f"{' '.join(options)}: {why}")
    raise RuntimeError("no llama.cpp build starts on this CPU: " + "; ".join(failures))


def source(cache: Path) -> Path:
    """The vendored llama.cpp of llama-cpp-python's source distribution, downloaded once."""
    tree = cache / f"llama_cpp_python-{VERSION}"
    if not tree.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        sdist = cache / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            subprocess.run([*pip, f"llama-cpp-python=={VERSION}", "-d", str(cache)], check=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    return tree / "vendor" / "llama.cpp"


def cmake_build(src: Path, folder: str, targets: list[str], options: list[str], jobs: int) -> Path:
    """A fresh build folder `folder` under `src` with `options`; returns its bin/ folder."""
    out = src / folder
    shutil.rmtree(out, ignore_errors=True)  # a cached GGML_NATIVE would outlive the new options
    nice = ["nice", "-n", "10"]
    subprocess.run([*nice, "cmake", "-S", str(src), "-B", str(out), *options, *COMMON], check=True)
    build = ["cmake", "--build", str(out), "-j", str(jobs), "--target", *targets]
    subprocess.run([*nice, *build], check=True)
    return out / "bin"


def default_gguf() -> Path | None:
    """The default model's GGUF (for a one-token start), where it has been fetched."""
    from kafila.models.default import DEFAULT_MODELS, DefaultModelUnavailable, locate_gguf

    try:
        return locate_gguf(DEFAULT_MODELS["smollm2-135m"])
    except DefaultModelUnavailable:  # not installed: start with --help instead
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, default=CACHE)
    p.add_argument("--rpc", action="store_true", help="the RPC build (build-rpc/) for benchmarks/ring_rpc.py")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    args = p.parse_args()
    src = source(args.cache)
    folder, targets = ("build-rpc", ["ggml-rpc-server", "llama-bench"]) if args.rpc else ("build", [])
    targets = targets or ["llama-bench", "llama-quantize", "llama-perplexity"]
    extra = ["-DGGML_RPC=ON"] if args.rpc else []
    gguf = default_gguf()

    def probe(bin_dir: Path) -> list[str]:
        bench = str(bin_dir / "llama-bench")
        return (
            [bench, "-m", str(gguf), "-p", "0", "-n", "1", "-r", "1", "-t", "1"]
            if gguf
            else [bench, "--help"]
        )

    flags = cpu_flags(Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").is_file() else set()
    options, bin_dir = build_that_starts(
        lambda opts: cmake_build(src, folder, targets, [*opts, *extra], args.jobs), probe, flags
    )
    (bin_dir.parent / "kafila-options.txt").write_text(" ".join([*options, *extra, *COMMON]) + "\n")
    print(f"[llama.cpp] {bin_dir} starts on this CPU, built with {' '.join(options + extra)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
