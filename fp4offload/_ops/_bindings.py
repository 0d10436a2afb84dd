"""The kernel API (see fp4offload/_ops/__init__.py) over a compiled extension: argument normalization only."""

from __future__ import annotations

from typing import Any, Callable

import torch

_U32 = 0xFFFFFFFF


def make_kernel_api(extension: Callable[[], Any]):
    """The six kernel-API functions calling `extension()`'s bindings (CPU or CUDA: same signatures)."""

    def nvfp4_encode(x, rows, cols, tile, scope, ufp4, stochastic, seed, stream, propagate, amax=None):
        if amax is not None:
            amax = amax.detach().to(device=x.device, dtype=torch.float32).reshape(-1).contiguous()
        data, scales, ts, count = extension().nvfp4_encode(x.contiguous(), rows, cols, tile, scope, ufp4, stochastic,
                                                           seed & _U32, stream & _U32, propagate, amax)
        return data, scales, ts, int(count)

    def nvfp4_decode(data, scales, tensor_scale, rows, cols, tile, scope, ufp4, out_dtype):
        return extension().nvfp4_decode(data.contiguous(), scales.contiguous(), tensor_scale.contiguous(), rows, cols,
                                        tile, scope, ufp4, out_dtype)

    def mx_encode(x, fp8, floor_mode, stochastic, seed, stream, propagate):
        data, scales, count = extension().mx_encode(x.contiguous(), fp8, floor_mode, stochastic, seed & _U32,
                                                    stream & _U32, propagate)
        return data, scales, int(count)

    def mx_decode(data, scales, numel, fp8, out_dtype):
        return extension().mx_decode(data.contiguous(), scales.contiguous(), numel, fp8, out_dtype)

    def int2_encode(x, stochastic, seed, stream, propagate):
        data, scales, ts, count = extension().int2_encode(x.contiguous(), stochastic, seed & _U32, stream & _U32,
                                                          propagate)
        return data, scales, ts, int(count)

    def int2_decode(data, scales, tensor_scale, numel, out_dtype):
        return extension().int2_decode(data.contiguous(), scales.contiguous(), tensor_scale.contiguous(), numel,
                                       out_dtype)

    return nvfp4_encode, nvfp4_decode, mx_encode, mx_decode, int2_encode, int2_decode
