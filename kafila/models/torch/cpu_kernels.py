"""Which path the compiled CPU products take (few_rows, quant_cpu, decode_cpu), and how to force one.

Each path sets the arithmetic of every product, so the bits of a result depend on it:

- "vnni": packed weights (int8, q4) by integer dot products, x rounded to int8 (q4, the int8 head)
  or int16 (int8 blocks) per group of 32 (quant_cpu, "integer dot products"); float weights in
  16-lane float32 vectors. Needs AVX-512 VNNI with AVX-512VL (Intel since Ice Lake, AMD since Zen 4).
- "avx512": every product in float32 (packed weights decoded to float32 as they are read), 16-lane
  vectors: four x rows per first pass. Needs AVX-512F (e.g. Skylake-X, which has no VNNI).
- "float": every product in float32, 8-lane vectors, three x rows per first pass: what a CPU without
  AVX-512 runs (AVX2 machines; ARM, where LLVM splits the vectors). Runs on every CPU.

$KAFILA_CPU_KERNELS picks one (unset or "auto": the first of these the CPU has). A path the CPU
cannot run is refused at import with the features it lacks. The path is read once, when
few_rows is first imported, and compiled into the kernels; numba's disk cache does not see that,
so a path other than the CPU's own keeps its compiled kernels in a cache folder of its own
(`cache_folder`). `python3 -m kafila.models.torch.cpu_kernels` prints the CPU, its paths and the
one in force.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV = "KAFILA_CPU_KERNELS"


@dataclass(frozen=True)
class KernelPath:
    name: str
    int_dot: bool  # packed products as integer dot products (quant_cpu.INT_DOT)
    lanes: int  # float32 lanes of the float products' vectors (few_rows.VF)
    needs: tuple[str, ...]  # LLVM's names of the CPU features it needs


PATHS = (  # fastest first: "auto" takes the first the CPU has
    KernelPath("vnni", True, 16, ("avx512f", "avx512vl", "avx512vnni")),
    KernelPath("avx512", False, 16, ("avx512f",)),
    KernelPath("float", False, 8, ()),
)
NAMES = tuple(p.name for p in PATHS)


def supported(features: Mapping[str, bool]) -> list[KernelPath]:
    """The paths a CPU with these LLVM features can run, fastest first (never empty: "float")."""
    return [p for p in PATHS if all(features.get(f) for f in p.needs)]


def choose(value: str | None, features: Mapping[str, bool], cpu: str = "this CPU") -> KernelPath:
    """The path $KAFILA_CPU_KERNELS=`value` names on a CPU with `features` (None, "" or "auto": the
    fastest it runs). ValueError for a name not in NAMES or a path the CPU cannot run."""
    runs = supported(features)
    want = (value or "auto").strip().lower()
    if want == "auto":
        return runs[0]
    path = next((p for p in PATHS if p.name == want), None)
    if path is None:
        raise ValueError(f"${ENV}={value!r} is not one of auto, {', '.join(NAMES)}")
    if path not in runs:
        lacks = [f for f in path.needs if not features.get(f)]
        raise ValueError(
            f"${ENV}={want} needs the CPU features {', '.join(path.needs)}; {cpu} lacks "
            f"{', '.join(lacks)} (it runs: {', '.join(p.name for p in runs)})"
        )
    return path


def host() -> tuple[str, dict[str, bool]]:
    """This CPU as LLVM (and so numba) names it, and its features."""
    from llvmlite import binding as llvm

    return llvm.get_host_cpu_name(), dict(llvm.get_host_cpu_features())


def cache_folder(path: KernelPath, default: KernelPath, numba_cache: str, kafila_cache: Path) -> str | None:
    """Where numba should cache the kernels compiled for `path` on a CPU whose own path is
    `default`: None (numba's usual place) for the CPU's own path, else a folder of the path's own,
    under $NUMBA_CACHE_DIR (`numba_cache`) when one is set, else under kafila's cache folder."""
    if path == default:
        return None
    base = Path(numba_cache) if numba_cache else kafila_cache / "numba"
    return str(base / f"kernels-{path.name}")


def _in_force() -> KernelPath:
    """The path from $KAFILA_CPU_KERNELS and this CPU; points numba's cache at its own folder
    when it is not the CPU's own path (before the kernels' modules are compiled)."""
    from numba.core import config

    from kafila.models.cache import cache_dir

    cpu, features = host()
    path = choose(os.environ.get(ENV), features, cpu)
    folder = cache_folder(path, supported(features)[0], config.CACHE_DIR, cache_dir())
    if folder is not None:
        config.CACHE_DIR = folder
    return path


PATH = _in_force()


def describe() -> str:
    """One line: the CPU, the paths it runs, the one in force and why."""
    cpu, features = host()
    runs = ", ".join(p.name for p in supported(features))
    given = os.environ.get(ENV)
    why = f"${ENV}={given}" if given and given.strip().lower() != "auto" else "auto"
    return f"cpu {cpu}; kernel paths it runs: {runs}; in force: {PATH.name} ({why})"


if __name__ == "__main__":
    print(describe())
