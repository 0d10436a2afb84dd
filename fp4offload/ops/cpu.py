"""The CPU backend: OpenMP + AVX-512/AVX2 kernels around csrc/fp4_codec.h."""

from __future__ import annotations

import functools

import torch

NAME = "cpu"


@functools.lru_cache(maxsize=None)
def extension():
    from .build import build

    return build("fp4offload_cpu", ["cpu/fp4_cpu.cpp"], extra_cflags=["-march=native", "-fopenmp"])


def nvfp4_encode(x, rows, cols, tile, scope, ufp4, stochastic, seed, stream, propagate, amax=None):
    if amax is not None:
        amax = amax.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()
    data, scales, ts, count = extension().nvfp4_encode(x.contiguous(), rows, cols, tile, scope, ufp4, stochastic,
                                                       seed & 0xFFFFFFFF, stream & 0xFFFFFFFF, propagate, amax)
    return data, scales, ts, int(count)


def nvfp4_decode(data, scales, tensor_scale, rows, cols, tile, scope, ufp4, out_dtype):
    return extension().nvfp4_decode(data.contiguous(), scales.contiguous(), tensor_scale.contiguous(), rows, cols,
                                    tile, scope, ufp4, out_dtype)


def mx_encode(x, fp8, floor_mode, stochastic, seed, stream, propagate):
    data, scales, count = extension().mx_encode(x.contiguous(), fp8, floor_mode, stochastic, seed & 0xFFFFFFFF,
                                                stream & 0xFFFFFFFF, propagate)
    return data, scales, int(count)


def mx_decode(data, scales, numel, fp8, out_dtype):
    return extension().mx_decode(data.contiguous(), scales.contiguous(), numel, fp8, out_dtype)


def threads() -> int:
    return torch.get_num_threads()
