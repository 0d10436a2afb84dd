"""The CPU backend: OpenMP kernels around csrc/fp4_codec.h, built for the host's vector path (ops/cpu_isa.py)."""

from __future__ import annotations

import torch

from ._bindings import make_kernel_api

NAME = "cpu"


def extension(isa: str | None = None):
    """The codec extension built for `isa` (default: this CPU's path, or FP4OFFLOAD_CPU_ISA); build.BuildError when
    it does not build."""
    from . import cpu_isa
    from .build import load

    isa = cpu_isa.chosen()[0] if isa is None else isa
    return load(cpu_isa.module_name("fp4offload_cpu", isa), ["cpu/fp4_cpu.cpp"],
                extra_cflags=[*cpu_isa.flags(isa), "-fopenmp"])


nvfp4_encode, nvfp4_decode, mx_encode, mx_decode, int2_encode, int2_decode = make_kernel_api(extension)


def threads() -> int:
    return torch.get_num_threads()
