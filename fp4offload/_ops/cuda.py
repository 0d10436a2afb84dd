"""The CUDA backend: kernels around csrc/fp4_codec.h (csrc/cuda), JIT-built for the devices present.

sm_90 (Hopper) and older targets use the software rules of the header; arch- or family-specific
targets from sm_100a on (Blackwell) also use the cvt.rn.satfinite.e2m1x2.f32 instruction for nearest
E2M1 rounding, which gives the same codes (see csrc/cuda/fp4_kernels.cu).
``FP4OFFLOAD_CUDA_ARCH`` (for example ``"90"`` or ``"90,100a"``) overrides the targets.
"""

from __future__ import annotations

import functools

import torch

from .. import _switches as switches
from ._bindings import make_kernel_api

NAME = "cuda"

SOURCES = ["cuda/fp4_cuda.cpp", "cuda/fp4_kernels.cu"]

#: nvcc flags on top of build.py's ``-O3 --fmad=false``: IEEE division, square root and subnormals,
#: never fast math (the codecs must round every multiply and divide on its own, as the reference does).
NVCC_FLAGS = ["-std=c++17", "--ftz=false", "--prec-div=true", "--prec-sqrt=true"]


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
        raise RuntimeError("the cuda backend needs a CUDA build of torch and a visible GPU "
                           f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'none'})")
    from .build import load

    return load("fp4offload_cuda", SOURCES, cuda=True, extra_cuda_cflags=nvcc_flags())


nvfp4_encode, nvfp4_decode, mx_encode, mx_decode = make_kernel_api(extension)


def hardware_e2m1(device: int | None = None) -> bool:
    """Whether the kernels running on `device` use the sm_100a E2M1 conversion instruction."""
    return bool(extension().hw_e2m1(torch.cuda.current_device() if device is None else int(device)))
