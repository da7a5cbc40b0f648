"""The CPU kernel paths (kafila.models.torch.cpu_kernels): which one each CPU kind takes, forcing
one with $KAFILA_CPU_KERNELS, and every path this CPU runs held to the kernel tests: a path only
another CPU kind takes by default (the float path of a machine without AVX-512, the float
products of one without VNNI) is still tested here, in a process of its own (the path is compiled
into the kernels at import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kafila.models.torch import cpu_kernels
from kafila.models.torch.cpu_kernels import ENV, NAMES, PATHS, cache_folder, choose, supported

# LLVM's feature sets of the CPU kinds the project meets (the flags that choose a path)
XEON_SAPPHIRE = {"avx2": True, "fma": True, "avx512f": True, "avx512vl": True, "avx512vnni": True}
ZEN4 = dict(XEON_SAPPHIRE)
SKYLAKE_X = {"avx2": True, "fma": True, "avx512f": True, "avx512vl": True, "avx512vnni": False}
AVX2_ONLY = {"avx2": True, "fma": True, "avx512f": False}
ARM: dict[str, bool] = {"neon": True}

ROOT = Path(__file__).resolve().parents[2]
# The kernel-level tests each path runs: products against exact references (numpy in float64,
# quant.dequantize), packed logits against the dequantized fp32 model, the fused decode step
# against torch's block code, and rows that do not depend on the batch.
KERNEL_TESTS = [
    "tests/models/test_cpu_kernels.py",
    "tests/models/test_quant.py::test_packed_products_match_the_dequantized_matrix_and_rows_do_not_depend_on_the_batch",
    "tests/models/test_quant.py::test_the_float_kernel_of_cpus_without_integer_dot_products_matches_the_dequantized_matrix",
    "tests/models/test_quant.py::test_packed_logits_match_the_dequantized_fp32_reference",
    "tests/models/test_quant.py::test_the_integer_products_round_each_group_of_x_as_the_reference_does",
    "tests/models/test_decode_cpu.py::test_few_row_product_equals_torch_for_any_output_width",
    "tests/models/test_decode_cpu.py::test_a_rows_product_is_the_same_bits_whatever_else_is_in_the_call",
    "tests/models/test_decode_cpu.py::test_fused_decode_matches_the_torch_block_code",
    "tests/models/test_decode_cpu.py::test_fused_decode_is_bit_identical_alone_or_batched",
    "tests/models/test_decode_cpu.py::test_the_products_vectors_are_as_wide_as_the_cpus_registers",
]


@pytest.mark.parametrize(
    ("features", "path"),
    [(XEON_SAPPHIRE, "vnni"), (ZEN4, "vnni"), (SKYLAKE_X, "avx512"), (AVX2_ONLY, "float"), (ARM, "float")],
)
def test_auto_takes_the_fastest_path_the_cpu_runs(features: dict[str, bool], path: str) -> None:
    assert choose(None, features).name == path
    assert choose("auto", features).name == path
    assert supported(features)[-1].name == "float"  # every CPU runs the float path


def test_a_named_path_is_forced_where_the_cpu_runs_it() -> None:
    assert [choose(name, XEON_SAPPHIRE).name for name in NAMES] == list(NAMES)
    assert choose(" AVX512 ", SKYLAKE_X).name == "avx512"
    assert (choose("avx512", ZEN4).int_dot, choose("avx512", ZEN4).lanes) == (False, 16)
    assert (choose("float", ZEN4).int_dot, choose("float", ZEN4).lanes) == (False, 8)


def test_a_path_the_cpu_cannot_run_is_refused_with_the_features_it_lacks() -> None:
    with pytest.raises(ValueError, match=r"KAFILA_CPU_KERNELS=vnni needs .* skylake-avx512 lacks avx512vnni"):
        choose("vnni", SKYLAKE_X, "skylake-avx512")
    with pytest.raises(ValueError, match=r"lacks avx512f, avx512vl, avx512vnni \(it runs: float\)"):
        choose("vnni", AVX2_ONLY)
    with pytest.raises(ValueError, match=r"'amx' is not one of auto, vnni, avx512, float"):
        choose("amx", XEON_SAPPHIRE)


def test_a_forced_path_other_than_the_cpus_own_compiles_into_a_cache_folder_of_its_own(tmp_path) -> None:
    own = choose(None, ZEN4)
    assert cache_folder(own, own, "", tmp_path) is None  # numba's usual place
    avx512, flt = choose("avx512", ZEN4), choose("float", ZEN4)
    assert cache_folder(avx512, own, "", tmp_path) == str(tmp_path / "numba" / "kernels-avx512")
    assert cache_folder(flt, own, "/nc", tmp_path) == str(Path("/nc") / "kernels-float")


def test_an_unknown_value_stops_the_import_with_the_values_it_takes() -> None:
    env = {**os.environ, ENV: "fastest", "PYTHONPATH": str(ROOT)}
    code = "import kafila.models.torch.few_rows"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode != 0
    assert "$KAFILA_CPU_KERNELS='fastest' is not one of auto, vnni, avx512, float" in run.stderr


def test_the_path_in_force_is_the_one_the_environment_names() -> None:
    """In the per-path runs below this checks that the kernels were built for the forced path."""
    from kafila.models.torch import few_rows, quant_cpu

    cpu, features = cpu_kernels.host()
    assert choose(os.environ.get(ENV), features, cpu) == cpu_kernels.PATH
    assert (cpu_kernels.PATH.int_dot, cpu_kernels.PATH.lanes) == (quant_cpu.INT_DOT, few_rows.VF)
    assert few_rows.FIRST_ROWS == quant_cpu.FIRST == (4 if cpu_kernels.PATH.lanes == 16 else 3)


def _paths_here() -> list[str]:
    return [p.name for p in supported(cpu_kernels.host()[1])]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a fresh machine compiles the path's kernels first (3-5 min here)
@pytest.mark.parametrize("name", [p.name for p in PATHS])
def test_every_path_this_cpu_runs_passes_the_kernel_tests(name: str) -> None:
    """The kernel tests (KERNEL_TESTS) in a process with $KAFILA_CPU_KERNELS=name, for each path
    this CPU runs other than the one this process took (the rest of the suite tests that one).
    A path the CPU lacks is reported as skipped, with the CPU: another CPU kind runs it."""
    if os.environ.get(ENV):
        pytest.skip(f"already inside the run of ${ENV}={os.environ[ENV]}")
    if name not in _paths_here():
        here = ", ".join(_paths_here())
        pytest.skip(f"{cpu_kernels.host()[0]} cannot run the {name} path (it runs {here})")
    if name == cpu_kernels.PATH.name:
        pytest.skip(f"{name} is the path this process runs: the whole suite tests it")
    # a pytest of its own: not an xdist worker's (its variables would make plugins think it is one)
    own = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    env = {**own, ENV: name, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *KERNEL_TESTS]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, f"${ENV}={name}:\n{tail}"
    assert " passed" in run.stdout and " failed" not in run.stdout, tail
