"""The compiled FP4AdamW steps: the CPU extension (csrc/cpu/adam_cpu.cpp) and, where CUDA builds, the CUDA one.

Both are optional: when a build fails the optimizer falls back to the torch reference step (same bits,
slower) and says so once.
"""

from __future__ import annotations

import warnings

_failed: dict[str, str] = {}


def _build_cpu(isa: str):
    from .._ops import cpu_isa
    from .._ops.build import load

    return load(cpu_isa.module_name("fp4offload_cpu_adam", isa), ["cpu/adam_cpu.cpp"],
                extra_cflags=[*cpu_isa.flags(isa), "-fopenmp"])


def _build_cuda():
    from .._ops.build import load

    return load("fp4offload_cuda_adam", ["cuda/adam_cuda.cpp", "cuda/adam_kernels.cu"], cuda=True,
                extra_cuda_cflags=["-std=c++17"])


def cpu_extension(isa: str | None = None):
    """The CPU extension module for the vector path `isa` (default: the one this CPU runs, or
    FP4OFFLOAD_CPU_ISA; see fp4offload._ops.cpu_isa), or None (with one warning) when it does not build."""
    from .._ops import cpu_isa

    if isa is None:
        isa = cpu_isa.chosen()[0]
    elif isa not in cpu_isa.available():
        raise ValueError(f"this CPU cannot run the {isa} path; it has {', '.join(cpu_isa.available())}")
    return _get(f"cpu ({isa})", lambda: _build_cpu(isa))


def cuda_extension():
    """The CUDA extension module, or None when CUDA or nvcc is missing or the build fails."""
    import torch

    if not torch.cuda.is_available():
        return None
    return _get("cuda", _build_cuda)


def _get(name, builder):
    """builder()'s extension (built once, by build.load), or None: a toolchain problem, said once; the step falls
    back to the reference."""
    try:
        return builder()
    except Exception as e:
        from .._ops.build import why

        if name not in _failed:
            _failed[name] = why(e)
            warnings.warn(f"fp4offload: the fused {name} FP4AdamW step does not build ({_failed[name]}); using the "
                          "torch reference step (same results, slower)", RuntimeWarning, stacklevel=3)
        return None


def failures() -> dict[str, str]:
    """Why a fused step is unavailable, by backend name ("cuda", or "cpu (<path>)")."""
    return dict(_failed)
