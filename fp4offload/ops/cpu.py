"""The CPU backend: OpenMP + AVX-512/AVX2 kernels around csrc/fp4_codec.h."""

from __future__ import annotations

import functools

import torch

from ._bindings import make_kernel_api

NAME = "cpu"


@functools.lru_cache(maxsize=None)
def extension():
    from .build import build

    return build("fp4offload_cpu", ["cpu/fp4_cpu.cpp"], extra_cflags=["-march=native", "-fopenmp"])


nvfp4_encode, nvfp4_decode, mx_encode, mx_decode = make_kernel_api(extension)


def threads() -> int:
    return torch.get_num_threads()
