"""Which vector instruction set the host CPU kernels run, and the compiler flags of each build.

Each CPU extension is built once per instruction set, as its own module (``fp4offload_cpu_avx2``, ...) with
its own target flags, never ``-march=native``: a build cache shared between hosts (a home directory on NFS)
then holds one module per path, and a host loads only a path its CPU reports. The path is read at run time
from the CPU (the kernel's view of cpuid, ``/proc/cpuinfo`` flags, on x86; ``getauxval(AT_HWCAP)`` on
AArch64) and can be forced with ``FP4OFFLOAD_CPU_ISA=auto|avx512|avx2|neon|sve|scalar`` (read by
:mod:`fp4offload._switches`). The paths, their flags and what each needs of the CPU are the rows of
:mod:`fp4offload._config.isas`.
"""

from __future__ import annotations

import ctypes
import functools
import platform

from .. import _switches as switches
from ..errors import ConfigError
from .._config import isas

ENV = "FP4OFFLOAD_CPU_ISA"
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


def row(name: str) -> isas.Isa:
    """The registry row of the path `name`."""
    return next(r for r in isas.ISAS if r.name == name)


def _has(r: isas.Isa) -> bool:
    """Whether this CPU runs the path `r`."""
    return ((not r.arch or r.arch == arch()) and all(f in _x86_flags() for f in r.cpu_flags)
            and (not r.hwcap or _hwcap() & r.hwcap == r.hwcap))


def available() -> list[str]:
    """The paths this CPU can run, fastest first (always ending with "scalar")."""
    return [r.name for r in isas.ISAS if _has(r)]


def _why_auto(best: str) -> str:
    r = row(best)
    if not r.flags:
        return f"auto: no vector path for this CPU ({arch()})"
    faster = [f for f in isas.ISAS[:isas.ISAS.index(r)] if f.arch == r.arch]
    if r.arch == "x86":
        have = _x86_flags()
        source, missing = "the CPU reports", dict.fromkeys(c for f in faster for c in f.cpu_flags if c not in have)
    else:
        source, missing = "getauxval(AT_HWCAP) reports", [f.reports for f in faster]
    return f"auto: {source} {r.reports}" + (f" but not {', '.join(missing)}" if missing else "")


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
    r = row(isa)
    return [*r.flags, f"-DFP4_CPU_ISA_ID={r.id}"]


def module_name(base: str, isa: str) -> str:
    """The extension module of `base` built for `isa` (one per path in the build cache)."""
    return f"{base}_{isa}"
