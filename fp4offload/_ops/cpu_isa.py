"""Which vector instruction set the host CPU kernels run, and the compiler flags of each build.

Each CPU extension is built once per instruction set, as its own module (``fp4offload_cpu_avx2``, ...) with
its own target flags, never ``-march=native``: a build cache shared between hosts (a home directory on NFS)
then holds one module per path, and a host loads only a path its CPU reports. The path is read at run time
from the CPU (the kernel's view of cpuid, ``/proc/cpuinfo`` flags, on x86; ``getauxval(AT_HWCAP)`` on
AArch64) and can be forced with ``FP4OFFLOAD_CPU_ISA=auto|avx512|avx2|neon|sve|scalar`` (read by
:mod:`fp4offload._switches`).
"""

from __future__ import annotations

import ctypes
import functools
import platform

from .. import _switches as switches
from .._config.vocab import CPU_ISAS
from ..errors import ConfigError

ENV = "FP4OFFLOAD_CPU_ISA"
#: every path, fastest first; "scalar" runs everywhere
ISAS = CPU_ISAS

#: the CPU flags each x86 path needs (/proc/cpuinfo names)
X86_NEEDS = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "bmi2", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
}
#: compiler flags per path: the x86 ones name each extension the code may use, so nothing depends on the
#: build host; FP4_CPU_VEC selects the vector step (csrc/cpu/adam_simd.h on NEON and AVX2, else
#: csrc/cpu/adam_chunk.h)
FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vbmi", "-mbmi2", "-mavx2", "-mfma",
               "-mf16c", "-mtune=generic"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mtune=generic", "-DFP4_CPU_VEC=1"],
    "neon": ["-march=armv8-a", "-DFP4_CPU_VEC=1"],
    "sve": ["-march=armv8.2-a+sve", "-DFP4_CPU_VEC=1"],
    "scalar": [],
}
#: the build's path as csrc/cpu/isa.h numbers it
ISA_IDS = {"scalar": 0, "avx512": 1, "avx2": 2, "neon": 3, "sve": 4}
_HWCAP_ASIMD = 1 << 1
_HWCAP_SVE = 1 << 22
_AT_HWCAP = 16


def arch() -> str:
    m = platform.machine().lower()
    if m in ("x86_64", "amd64", "i686", "i386"):
        return "x86"
    if m in ("aarch64", "arm64"):
        return "aarch64"
    return m


@functools.lru_cache(maxsize=None)
def _x86_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=None)
def _hwcap() -> int:
    try:
        libc = ctypes.CDLL(None)
        libc.getauxval.restype = ctypes.c_ulong
        libc.getauxval.argtypes = [ctypes.c_ulong]
        return int(libc.getauxval(_AT_HWCAP))
    except (OSError, AttributeError):
        return 0


def available() -> list[str]:
    """The paths this CPU can run, fastest first (always ending with "scalar")."""
    a = arch()
    out = []
    if a == "x86":
        have = _x86_flags()
        out = [isa for isa in ("avx512", "avx2") if all(f in have for f in X86_NEEDS[isa])]
    elif a == "aarch64":
        cap = _hwcap()
        if cap & _HWCAP_SVE:
            out.append("sve")
        if cap & _HWCAP_ASIMD:
            out.append("neon")
    return out + ["scalar"]


def _why_auto(best: str) -> str:
    a = arch()
    if best == "avx512":
        return "auto: the CPU reports AVX-512 F/BW/VL/DQ/VBMI and BMI2"
    if best == "avx2":
        missing = [f for f in X86_NEEDS["avx512"] if f not in _x86_flags()]
        return f"auto: the CPU reports AVX2, FMA and F16C but not {', '.join(missing)}"
    if best in ("sve", "neon"):
        return f"auto: getauxval(AT_HWCAP) reports {'SVE' if best == 'sve' else 'ASIMD (NEON) but not SVE'}"
    return f"auto: no vector path for this CPU ({a})"


def chosen() -> tuple[str, str]:
    """(path, why) for this process: FP4OFFLOAD_CPU_ISA when set (checked against this CPU), else the fastest
    path the CPU has. A path the CPU lacks, or an unknown value, is a ConfigError naming what it has."""
    have = available()
    try:
        want = switches.get(ENV)
    except ConfigError as exc:
        raise ConfigError(ENV, exc.value, exc.allowed,
                          f"This CPU has {', '.join(have)}; unset it to pick automatically") from None
    if want == "auto":
        return have[0], _why_auto(have[0])
    if want not in have:
        raise ConfigError(ENV, want, f"a path this CPU has: {', '.join(have)}",
                          "Set one of those, or unset it to pick automatically")
    return want, f"{ENV}={want}"


def flags(isa: str) -> list[str]:
    """The compiler flags of `isa`'s build."""
    return [*FLAGS[isa], f"-DFP4_CPU_ISA_ID={ISA_IDS[isa]}"]


def module_name(base: str, isa: str) -> str:
    """The extension module of `base` built for `isa` (one per path in the build cache)."""
    return f"{base}_{isa}"
