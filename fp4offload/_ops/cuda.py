"""The CUDA backend: kernels around csrc/fp4_codec.h (csrc/cuda), JIT-built for the devices present.

sm_90 (Hopper) and older targets use the software rules of the header; arch- or family-specific
targets from sm_100a on (Blackwell) also use the cvt.rn.satfinite.e2m1x2.f32 instruction for nearest
E2M1 rounding, which gives the same codes (see csrc/cuda/fp4_kernels.cu).
``FP4OFFLOAD_CUDA_ARCH`` (for example ``"90"`` or ``"90,100a"``) overrides the targets.

On a ROCm build of torch (``torch.version.hip`` set) the same sources build with hipcc for AMD GPUs
(csrc/cuda/gpu_compat.h maps the CUDA names; torch's JIT hipifies the bindings): :data:`HIPCC_FLAGS` and one
``--offload-arch`` per target, from ``PYTORCH_ROCM_ARCH`` (torch's variable, for example ``"gfx90a;gfx942"``) or
else every visible GPU. The kernels run wave64 (``-mwavefrontsize64``). This path is compile-checked for gfx90a
(tests/emulation/test_hip_compile.py) and has never run on AMD hardware.
"""

from __future__ import annotations

import functools
import os
import re

import torch

from .. import _switches as switches
from ._bindings import make_kernel_api

NAME = "cuda"

SOURCES = ["cuda/fp4_cuda.cpp", "cuda/fp4_kernels.cu"]

#: nvcc flags on top of build.py's ``-O3 --fmad=false``: IEEE division, square root and subnormals,
#: never fast math (the codecs must round every multiply and divide on its own, as the reference does).
NVCC_FLAGS = ["-std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true"]


#: hipcc (clang) flags on top of build.py's ``-O3`` for ROCm, the counterparts of NVCC_FLAGS and ``--fmad=false``:
#: no FMA contraction (HIP's default contracts), correctly rounded fp32 division and square root (sqrtf; HIP's
#: __fsqrt_rn is the native approximation, which csrc/cuda/gpu_compat.h maps to sqrtf), subnormals kept, and 64-lane
#: waves on every target (RDNA defaults to wave32; the kernels' kWarp is 64 under HIP).
HIPCC_FLAGS = ["-std=c++17", "-ffp-contract=off", "-fhip-fp32-correctly-rounded-divide-sqrt",
               "-fno-gpu-flush-denormals-to-zero", "-mwavefrontsize64"]
#: flags only nvcc takes, left out of a ROCm build's command line (build.py)
NVCC_ONLY_PREFIXES = ("--fmad", "--ftz", "--prec-div", "--prec-sqrt", "--use_fast_math", "-gencode", "-arch=sm_",
                      "--expt-")


def is_rocm() -> bool:
    """Whether torch is a ROCm build (``torch.version.hip`` set): its "cuda" device is an AMD GPU and extensions
    build with hipcc."""
    return getattr(torch.version, "hip", None) is not None


def rocm_archs() -> list[str]:
    """The AMD targets (gfx names) to build for: ``PYTORCH_ROCM_ARCH`` (``;``, ``,`` or space separated), else
    the architecture of every visible GPU (``gcnArchName`` less its feature suffix, ``gfx90a:sramecc+:xnack-``)."""
    env = os.environ.get("PYTORCH_ROCM_ARCH", "").strip()
    if env:
        archs = [a for a in re.split(r"[;,\s]+", env) if a]
        bad = [a for a in archs if not re.fullmatch(r"gfx[0-9a-f]+(:[\w+-]+)*", a)]
        if bad:
            raise ValueError(f"PYTORCH_ROCM_ARCH={env!r}: {bad[0]!r} is not an AMD GPU target; name gfx targets "
                             "separated by ';' (for example 'gfx90a;gfx942')")
        return archs
    return sorted({torch.cuda.get_device_properties(i).gcnArchName.split(":", 1)[0]
                   for i in range(torch.cuda.device_count())})


def hipcc_flags(archs: list[str] | None = None) -> list[str]:
    """Everything this backend adds to the hipcc command line on ROCm (tests compile with the same list)."""
    archs = rocm_archs() if archs is None else list(archs)
    if not archs:
        raise RuntimeError("no AMD GPU target to build for: set PYTORCH_ROCM_ARCH (for example 'gfx90a' or "
                           "'gfx942') or make a GPU visible")
    return [*HIPCC_FLAGS, *(f"--offload-arch={a}" for a in archs)]


def device_flags(archs: list[str] | None = None) -> list[str]:
    """The device compiler's flags for this torch: :func:`hipcc_flags` on ROCm, else :func:`nvcc_flags`."""
    return hipcc_flags(archs) if is_rocm() else nvcc_flags(archs)


def _arch_for(major: int, minor: int) -> str:
    """Target name for a compute capability: arch-specific ('100a') from sm_100 on, else plain ('90')."""
    return f"{major}{minor}a" if major >= 10 else f"{major}{minor}"


def arch_flags(archs: list[str] | None = None) -> list[str]:
    """``-gencode`` flags for `archs` (default: FP4OFFLOAD_CUDA_ARCH, else every visible device).

    Passing any ``arch`` flag stops torch's cpp_extension from adding its own, so the build holds exactly
    these targets. ``-arch=sm_100a`` alone fails in ptxas; the ``-gencode`` form is what works.
    """
    if archs is None:
        env = switches.get("FP4OFFLOAD_CUDA_ARCH")  # a tuple of targets, "sm_" dropped, or None
        if env:
            archs = list(env)
        else:
            archs = sorted({_arch_for(*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())})
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def nvcc_flags(archs: list[str] | None = None) -> list[str]:
    """Everything this backend adds to the nvcc command line (tests compile with the same list)."""
    return [*NVCC_FLAGS, *arch_flags(archs)]


@functools.lru_cache(maxsize=None)
def extension():
    """Build (or load the cached build of) the CUDA extension; raises when torch sees no CUDA device, and
    build.BuildError when it does not build."""
    if not torch.cuda.is_available():
        raise RuntimeError("the cuda backend needs a CUDA or ROCm build of torch and a visible GPU "
                           f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, "
                           f"ROCm {getattr(torch.version, 'hip', None) or 'none'})")
    from .build import load

    return load("fp4offload_cuda", SOURCES, cuda=True, extra_cuda_cflags=device_flags())


nvfp4_encode, nvfp4_decode, mx_encode, mx_decode, int2_encode, int2_decode = make_kernel_api(extension)


def hardware_e2m1(device: int | None = None) -> bool:
    """Whether the kernels running on `device` use the sm_100a E2M1 conversion instruction."""
    return bool(extension().hw_e2m1(torch.cuda.current_device() if device is None else int(device)))
