"""`quantize` and `dequantize`: the public face of the codecs, with argument checking and dispatch.

Owns the checks of the public arguments and the dispatch to a backend (fp4offload._ops). What a packed
tensor looks like (formats, the rows/cols view, sizes) is fp4offload/formats/layout.py's, the container
fp4offload/formats/packed.py's; both sit below this module and import nothing from it. This module installs
its ``dequantize`` as the decoder behind ``PackedTensor.dequantize`` (``packed.set_decoder``).
"""

from __future__ import annotations

import math

import torch

from ._config import NONFINITE_MODES, ROUNDINGS, SCALE_MODES
from ._config.checks import check_choice, one_of
from .errors import ConfigError, NonFiniteError
from .formats import packed as _packed
from .formats.layout import FORMATS, packed_sizes, rows_cols
from .formats.packed import PackedTensor
from ._ops import backend_for

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(x, fmt, block, rounding, scale_scope, nonfinite, scale_mode) -> str:
    if not isinstance(x, torch.Tensor):
        raise ConfigError("x", type(x).__name__, "a torch.Tensor")
    if x.dtype not in _FLOAT_DTYPES:
        raise ConfigError("x.dtype", x.dtype, "torch.float32, torch.bfloat16 or torch.float16",
                          "cast the tensor first, e.g. x.float()")
    if x.device.type not in ("cpu", "cuda"):
        raise ConfigError("x.device", str(x.device), "a cpu or cuda tensor")
    check_choice("fmt", fmt, tuple(FORMATS))
    allowed, default = FORMATS[fmt]
    block = default if block is None else block
    if block not in allowed:
        raise ConfigError("block", block, f"{one_of(allowed)} for fmt={fmt!r}")
    check_choice("rounding", rounding, ROUNDINGS)
    if rounding == "stochastic" and fmt not in ("nvfp4", "ufp4", "mxfp4", "int2"):
        raise ConfigError("rounding", rounding, f"'nearest' for fmt={fmt!r} (stochastic rounding is for nvfp4, ufp4, "
                          "mxfp4, int2)")
    check_choice("nonfinite", nonfinite, NONFINITE_MODES)
    check_choice("scale_mode", scale_mode, SCALE_MODES)
    if scale_scope is not None:
        if fmt not in ("nvfp4", "ufp4") or block != "1x16":
            raise ConfigError("scale_scope", scale_scope, "None for this format and block",
                              "per-chunk tensor scales exist for nvfp4/ufp4 with block='1x16'")
        if isinstance(scale_scope, bool) or not isinstance(scale_scope, int) or scale_scope <= 0 or scale_scope % 16:
            raise ConfigError("scale_scope", scale_scope,
                              "None or a positive multiple of 16 (elements per tensor scale)")
    return block


def quantize(x: torch.Tensor, fmt: str = "nvfp4", *, block: str | None = None, rounding: str = "nearest",
             seed: int = 0, scale_scope: int | None = None, nonfinite: str = "raise", scale_mode: str = "rceil",
             stream: int = 0, name: str | None = None, amax: torch.Tensor | float | None = None) -> PackedTensor:
    """Quantize a floating tensor to a 4-bit (or MXFP8) format.

    Args:
        x: fp32, bf16 or fp16 tensor on CPU or CUDA; any shape, contiguous or not.
        fmt: ``"nvfp4"`` (E2M1, E4M3 scale per 16, fp32 tensor scale), ``"mxfp4"`` (E2M1, E8M0 scale per 32),
            ``"mxfp8"`` (E4M3, E8M0 per 32), ``"ufp4"`` (unsigned, no zero; for sqrt of Adam's v) or ``"int2"``
            (2-bit codes on the levels -3, -1, 1, 3 of an E4M3 scale per 16 rounded up, fp32 tensor scale: 0.3125
            B/element; for saved activations, stochastically rounded).
        block: ``"1x16"`` or ``"16x16"`` for nvfp4 (default ``"1x16"``), ``"1x32"`` for the MX formats;
            ``None`` takes the format's default.
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (nvfp4, ufp4, mxfp4 and int2).
        seed, stream: select the counter-based random bits of stochastic rounding (docs/design.md 3.9).
        scale_scope: elements per fp32 tensor scale for 1x16 nvfp4/ufp4 (a multiple of 16); ``None``: whole tensor.
        nonfinite: ``"raise"`` (NonFiniteError naming the tensor and the count) or ``"propagate"`` (the block
            decodes to NaN).
        scale_mode: MX only, ``"rceil"`` (nothing clips) or ``"floor"`` (OCP v1.0).
        name: how errors refer to the tensor.
        amax: nvfp4/ufp4 only: the amax (one value, or one per scope) the tensor scale is computed from,
            instead of the measured one. Sharded weights pass the amax max-reduced across ranks so every
            rank encodes with the same tensor scale. Values above it saturate at the format's maximum.
    """
    block = _check(x, fmt, block, rounding, scale_scope, nonfinite, scale_mode)
    if fmt == "ufp4" and x.numel() and bool(x.amin() < 0):  # a reduction: no mask tensor
        raise ConfigError(name or "x", "a tensor with negative values", "non-negative values for fmt='ufp4'",
                          "ufp4 is unsigned; it stores sqrt(v) of Adam's second moment")
    if amax is not None:
        if fmt not in ("nvfp4", "ufp4"):
            raise ConfigError("amax", amax, f"None for fmt={fmt!r} (an amax override exists for nvfp4 and ufp4)")
        amax = torch.as_tensor(amax, dtype=torch.float32).reshape(-1)
        if not bool(torch.isfinite(amax).all()) or bool((amax < 0).any()):
            raise ConfigError("amax", amax.tolist(), "finite, non-negative values")
    kern = backend_for(x.device)
    rows, cols = rows_cols(x.shape)
    src = x.detach().contiguous()
    stochastic = rounding == "stochastic"
    propagate = nonfinite == "propagate"
    if fmt in ("nvfp4", "ufp4"):
        tile = 16 if block == "16x16" else 1
        nscopes = packed_sizes(fmt, block, x.shape, scale_scope or 0).tensor_scales
        if amax is not None:
            if amax.numel() == 1:
                amax = amax.expand(nscopes)
            if amax.numel() != nscopes:
                raise ConfigError("amax", f"{amax.numel()} values", f"1 or {nscopes} (one per scale scope)")
            amax = amax.to(x.device).contiguous()
        data, scales, ts, count = kern.nvfp4_encode(src, rows, cols, tile, scale_scope or 0, fmt == "ufp4",
                                                    stochastic, seed, stream, propagate, amax)
    elif fmt == "int2":
        data, scales, ts, count = kern.int2_encode(src, stochastic, seed, stream, propagate)
    else:
        data, scales, count = kern.mx_encode(src, fmt == "mxfp8", scale_mode == "floor", stochastic, seed, stream,
                                             propagate)
        ts = None
    if count and not propagate:
        raise NonFiniteError(name or "x", count, x.numel())
    if ts is None and not propagate:
        _check_mx_overflow(kern, data, scales, x, fmt, name)
    return PackedTensor(data, scales, ts, x.shape, x.dtype, fmt, block, scale_scope or 0)


_MX_MAX_ELEMENT = {"mxfp4": 6.0, "mxfp8": 448.0}


def _check_mx_overflow(kern, data, scales, x: torch.Tensor, fmt: str, name: str | None) -> None:
    """MX only: finite inputs whose code, rounded up to the top of its block's E8M0 scale, decodes past the
    largest value of x's dtype (an fp32 block near 3.4e38, an fp16 one near 65504) come back as Inf. Such blocks
    need a scale of at least 2**floor(log2(dtype max / largest element)); only when one has it is the tensor
    decoded (in x's dtype, as dequantize does) and its non-finite outputs counted: NonFiniteError under
    ``nonfinite="raise"``. The encoded bytes are the same on every backend; this only reads them."""
    if not scales.numel():
        return
    e_min = math.floor(math.log2(torch.finfo(x.dtype).max / _MX_MAX_ELEMENT[fmt]))
    if int(scales.max()) < 127 + e_min:  # E8M0: the byte is the exponent + 127
        return
    out = kern.mx_decode(data, scales, x.numel(), fmt == "mxfp8", x.dtype)
    bad = int((~torch.isfinite(out)).sum())
    if bad:
        raise NonFiniteError(f"{name or 'x'} (finite values near the {x.dtype} maximum that {fmt} rounds up to "
                             "Inf on decode; scale the tensor down, or use fmt='nvfp4', whose tensor scale avoids "
                             "this)", bad, x.numel())


def dequantize(packed: PackedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Decode a PackedTensor to `dtype` (default: the source dtype), in its original shape, on its device."""
    if not isinstance(packed, PackedTensor):
        raise ConfigError("packed", type(packed).__name__, "a PackedTensor from fp4offload.quantize")
    dtype = packed.dtype if dtype is None else dtype
    if dtype not in _FLOAT_DTYPES:
        raise ConfigError("dtype", dtype, "torch.float32, torch.bfloat16 or torch.float16")
    kern = backend_for(packed.device)
    if packed.format in ("nvfp4", "ufp4"):
        rows, cols = packed.rows_cols
        tile = 16 if packed.block == "16x16" else 1
        out = kern.nvfp4_decode(packed.data, packed.scales, packed.tensor_scale, rows, cols, tile,
                                packed.scale_scope, packed.format == "ufp4", dtype)
    elif packed.format == "int2":
        out = kern.int2_decode(packed.data, packed.scales, packed.tensor_scale, packed.numel, dtype)
    else:
        out = kern.mx_decode(packed.data, packed.scales, packed.numel, packed.format == "mxfp8", dtype)
    return out.reshape(packed.shape)


_packed.set_decoder(dequantize)
