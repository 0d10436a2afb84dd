"""The host kernels' vector paths (CPU instruction sets), one row each: the table every list of them derives from.

Each path is its own build of the CPU extensions (module ``<base>_<name>``, compiled with the row's ``flags`` and
``-DFP4_CPU_ISA_ID=<id>``; cpu_isa.py), and a host runs the first row, in this order, that its CPU has: an x86 row
needs every ``cpu_flags`` name in /proc/cpuinfo's flags, an AArch64 row every bit of ``hwcap`` in
getauxval(AT_HWCAP); the last row, scalar, runs everywhere. Derived from the rows: the vocabulary's ``CPU_ISAS``
(_config/vocab.py, hence the words of ``FP4OFFLOAD_CPU_ISA``), the planner's ``CPU_FP4_PER_CORE``
(_planner/hardware.py) and csrc/cpu/isas.h, whose X-macro ``FP4_CPU_ISAS`` gives a build its name
(csrc/cpu/isa.h). The header is generated (:func:`write_header`) and committed;
tests/unit/test_registries.py checks it is current. This module imports nothing of the package.

``fp4_per_core`` is the FP4 step's planned rate per core, parameters/s, when nothing was measured. avx512 measured
2026-11-29 on a 2-core AMD EPYC VM (``python benchmarks/optimizer.py --numel 16M --threads 1 --rounds 5``: 738 M/s);
avx2 2026-12-04 on a 2-core Intel Xeon VM with the path forced (``--threads 2 --optimizers fp4adamw@avx2``: 489 M/s);
both rounded down. neon and sve (128-bit vectors, as on Grace) are a model, half the AVX2 rate, not a measurement;
scalar measured on an AVX2 host before its vector path existed (59 M/s on 2 threads).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .cheader import x_macro

_HWCAP_ASIMD = 1 << 1
_HWCAP_SVE = 1 << 22


class Isa(NamedTuple):
    name: str  #: the path's name (FP4OFFLOAD_CPU_ISA, the module suffix)
    id: int  #: FP4_CPU_ISA_ID of its build
    arch: str  #: "x86", "aarch64", or "" (any)
    flags: tuple[str, ...]  #: compiler flags of its build (FP4_CPU_VEC=1: the SIMD-layer step, csrc/cpu/adam_simd.h)
    fp4_per_core: float  #: the planner's FP4 step rate per core, parameters/s (see above)
    cpu_flags: tuple[str, ...] = ()  #: x86: /proc/cpuinfo flags the CPU must report
    hwcap: int = 0  #: aarch64: AT_HWCAP bits the CPU must report
    reports: str = ""  #: what the CPU reports, in words (the reason `auto` gives)
    width: int = 0  #: vector width in bits (SVE: the least, its code is vector-length agnostic; scalar: 0)


#: fastest first; the flags name each extension the code may use, never -march=native, so no build depends on the
#: build host
ISAS = (
    Isa("avx512", 1, "x86", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vbmi", "-mbmi2", "-mavx2",
                             "-mfma", "-mf16c", "-mtune=generic"), 7.0e8,
        cpu_flags=("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "bmi2", "avx2", "fma", "f16c"),
        reports="AVX-512 F/BW/VL/DQ/VBMI and BMI2", width=512),
    Isa("avx2", 2, "x86", ("-mavx2", "-mfma", "-mf16c", "-mtune=generic", "-DFP4_CPU_VEC=1"), 2.4e8,
        cpu_flags=("avx2", "fma", "f16c"), reports="AVX2, FMA and F16C", width=256),
    Isa("sve", 4, "aarch64", ("-march=armv8.2-a+sve", "-DFP4_CPU_VEC=1"), 1.2e8, hwcap=_HWCAP_SVE, reports="SVE",
        width=128),
    Isa("neon", 3, "aarch64", ("-march=armv8-a", "-DFP4_CPU_VEC=1"), 1.2e8, hwcap=_HWCAP_ASIMD,
        reports="ASIMD (NEON)", width=128),
    Isa("scalar", 0, "", (), 3.0e7),
)

HEADER = "cpu/isas.h"  # under csrc/
CSRC = Path(__file__).resolve().parents[2] / "csrc"  # the source checkout's


def check(rows=ISAS) -> None:
    """ValueError unless `rows` is a usable table: distinct names (C identifiers) and ids, scalar last."""
    for field in ("name", "id"):
        seen = [getattr(r, field) for r in rows]
        if len(set(seen)) != len(seen):
            raise ValueError(f"CPU paths: a {field} appears twice: {seen}")
    if not all(r.name.isidentifier() for r in rows) or rows[-1].arch or rows[-1].flags:
        raise ValueError("CPU paths: names must be identifiers, and the last row the scalar build (any arch, no flags)")


def header(rows=ISAS) -> str:
    """The text of csrc/cpu/isas.h for `rows`."""
    check(rows)
    return x_macro("isas", "ISAS", "FP4_CPU_ISAS(X) calls X(name, id) for every vector path of the host kernels, "
                   "fastest first.", "FP4_CPU_ISAS(X)", [f"X({r.name}, {r.id})" for r in rows])


def write_header(csrc: Path | str = CSRC, rows=ISAS) -> Path:
    """Write header(rows) under `csrc` (csrc/cpu/isas.h); returns its path."""
    path = Path(csrc) / HEADER
    path.write_text(header(rows))
    return path
