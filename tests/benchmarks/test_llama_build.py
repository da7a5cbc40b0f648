"""benchmarks/llama_build.py: the llama.cpp build the benchmarks compare with starts on this CPU, or
is made again without -march=native and AMX. Its start check runs real programs; a CPU that cannot
run the native build is simulated by a native "build" whose binary dies of SIGILL, as the native
build did on a Xeon guest listing AMX it could not run."""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("llama_build", ROOT / "benchmarks" / "llama_build.py")
assert _spec is not None and _spec.loader is not None
llama_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(llama_build)

# /proc/cpuinfo's flags on the 2-vCPU Xeon (family 6 model 167 guest) whose native build died of SIGILL
XEON_FLAGS = (
    "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512vl avx512bw "
    "avx512vbmi avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_int8 amx_bf16"
)


def _program(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_program_killed_by_sigill_does_not_start_and_says_so(tmp_path) -> None:
    dies = _program(tmp_path, "dies", "kill -ILL $$")
    assert llama_build.start_failure([str(dies)]) == f"{dies} was killed by SIGILL"


def test_a_program_that_exits_0_starts_and_one_that_fails_says_how(tmp_path) -> None:
    assert llama_build.start_failure([str(_program(tmp_path, "ok", "exit 0"))]) is None
    fails = _program(tmp_path, "fails", "echo 'no model' >&2; exit 3")
    assert llama_build.start_failure([str(fails)]) == f"{fails} exited with 3: no model"
    assert "cannot be run" in llama_build.start_failure([str(tmp_path / "absent")])
    slow = _program(tmp_path, "slow", "sleep 5")
    assert llama_build.start_failure([str(slow)], timeout=0.5) == f"{slow} did not end within 0.5 s"


def test_cpuinfo_flags_turn_into_ggml_options_with_amx_off() -> None:
    flags = llama_build.cpu_flags(f"processor\t: 0\nflags\t\t: {XEON_FLAGS}\nbugs\t\t: spectre\n")
    assert "amx_tile" in flags and "avx512_vnni" in flags
    options = llama_build.portable_options(flags)
    assert options[0] == "-DGGML_NATIVE=OFF"
    for on in ("AVX", "AVX2", "FMA", "F16C", "AVX512", "AVX512_VNNI", "AVX512_BF16"):
        assert f"-DGGML_{on}=ON" in options
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(options)
    avx2 = llama_build.portable_options(llama_build.cpu_flags("flags : avx avx2 fma f16c"))
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2
    assert llama_build.cpu_flags("Features : fp asimd") == {"fp", "asimd"}  # ARM's name for the line


def _builds(tmp_path: Path, native_body: str) -> tuple[list[list[str]], object]:
    """A `make` that "builds" a llama-bench per option set: the native one runs `native_body`."""
    made: list[list[str]] = []

    def make(options: list[str]) -> Path:
        made.append(options)
        folder = tmp_path / f"build{len(made)}"
        folder.mkdir()
        _program(folder, "llama-bench", native_body if options == llama_build.NATIVE else "exit 0")
        return folder

    return made, make


def test_simulated_native_build_killed_by_sigill_falls_back_to_the_portable_build(tmp_path, capsys) -> None:
    made, make = _builds(tmp_path, "kill -ILL $$")
    flags = {f for f in llama_build.cpu_flags(f"flags : {XEON_FLAGS}") if not f.startswith("amx")}
    options, binary = llama_build.build_that_starts(make, lambda b: [str(b / "llama-bench")], flags)
    assert made == [llama_build.NATIVE, llama_build.portable_options(flags)]
    assert options == llama_build.portable_options(flags) and binary == tmp_path / "build2"
    err = capsys.readouterr().err
    assert "built with -DGGML_NATIVE=ON: " in err and "llama-bench was killed by SIGILL" in err


def test_a_cpu_listing_amx_gets_the_portable_build_alone(tmp_path) -> None:
    """A guest listing AMX may run a native build's first token and die on a Q8_0 or K-quant file
    (the types ggml's AMX kernels take), so the start check would not catch it: no native build."""
    made, make = _builds(tmp_path, "exit 0")
    flags = llama_build.cpu_flags(f"flags : {XEON_FLAGS}")
    options, binary = llama_build.build_that_starts(make, lambda b: [str(b / "llama-bench")], flags)
    assert made == [llama_build.portable_options(flags)] and binary == tmp_path / "build1"
    assert "-DGGML_AMX_INT8=OFF" in options


def test_a_native_build_that_starts_is_kept(tmp_path) -> None:
    made, make = _builds(tmp_path, "exit 0")
    options, binary = llama_build.build_that_starts(make, lambda b: [str(b / "llama-bench")], set())
    assert (made, options, binary) == ([llama_build.NATIVE], llama_build.NATIVE, tmp_path / "build1")


def test_simulated_cpu_where_no_build_starts_says_why_for_each(tmp_path) -> None:
    def make(options: list[str]) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        _program(folder, "llama-bench", "kill -ILL $$")
        return folder

    with pytest.raises(RuntimeError, match=r"-DGGML_NATIVE=ON: .*SIGILL; -DGGML_NATIVE=OFF .*SIGILL"):
        llama_build.build_that_starts(make, lambda b: [str(b / "llama-bench")], set())
    assert os.access(tmp_path / "0" / "llama-bench", os.X_OK)
