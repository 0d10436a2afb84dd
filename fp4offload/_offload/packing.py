"""Turning one saved activation into a few flat byte tensors and back (format + memory layout).

Non-finite values: the 4-bit and MX codecs run with ``nonfinite="propagate"`` (a block holding Inf/NaN decodes
to NaN), and :func:`encode_counted` hands back how many the tensor held, so the offloader (hooks.py) can keep
such a tensor exactly instead: one -inf would otherwise turn its 15 or 31 neighbours into NaN, and a clamp-like
backward would then zero their gradients without a sign.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._codec import dequantize, quantize
from ..formats.packed import PackedTensor
from .pinned_pool import ALIGN

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_dense(t: torch.Tensor) -> bool:
    """True when `t` covers its memory exactly once (contiguous, or a permutation of contiguous)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass
class Layout:
    """What it takes to rebuild a tensor from its parts.

    `spans` lists (name, dtype, shape, offset, nbytes) of each part inside one flat byte buffer, each
    part aligned to ALIGN bytes, so the parts can live in one host block, one file or one device buffer.
    """

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    fmt: str
    header: dict | None
    spans: list[tuple[str, torch.dtype, tuple[int, ...], int, int]]

    @property
    def nbytes(self) -> int:
        """Bytes of the parts (what is kept)."""
        return sum(s[4] for s in self.spans)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the flat buffer that holds every part at its aligned offset."""
        return self.spans[-1][3] + self.spans[-1][4] if self.spans else 0


_fast_ok = True


def quantize_async(src: torch.Tensor, fmt: str, stochastic: bool = False, seed: int = 0) -> PackedTensor:
    """``quantize(src, fmt, nonfinite="propagate")`` without reading the non-finite count back."""
    return quantize_counted(src, fmt, stochastic, seed)[0]


def quantize_counted(src: torch.Tensor, fmt: str, stochastic: bool = False,
                     seed: int = 0) -> tuple[PackedTensor, int | torch.Tensor]:
    """``quantize(src, fmt, nonfinite="propagate")`` and the count of non-finite values of `src`, not read back.

    ``quantize`` turns the kernels' count into a Python int, which on CUDA waits for the device: once
    per saved tensor, that would stall the host behind the GPU. With ``propagate`` the count is not
    needed (non-finite blocks decode to NaN), so this calls the backend's extension directly with the
    arguments ``quantize`` passes (fmt nvfp4 1x16 whole-tensor scale, int2, or MX 1x32 rceil), and falls back
    to ``quantize`` where that is not possible. The count is the kernel's int64 tensor, on the source's device
    (an int on the fallback path): reading it on CUDA waits for the device, so the caller decides when.
    """
    global _fast_ok
    if _fast_ok and src.device.type in ("cpu", "cuda"):
        from ..formats.layout import rows_cols
        from .._ops import backend_for

        kern = backend_for(src.device)
        ext = getattr(kern, "extension", None)
        if getattr(kern, "NAME", None) in ("cpu", "cuda") and ext is not None:
            x = src.contiguous()
            try:
                if fmt == "int2":
                    data, scales, ts, count = ext().int2_encode(x, stochastic, seed & 0xFFFFFFFF, 0, True)
                    return PackedTensor(data, scales, ts, x.shape, x.dtype, "int2", "1x16", 0), count
                if fmt == "nvfp4":
                    rows, cols = rows_cols(x.shape)
                    data, scales, ts, count = ext().nvfp4_encode(x, rows, cols, 1, 0, False, stochastic,
                                                                 seed & 0xFFFFFFFF, 0, True, None)
                    return PackedTensor(data, scales, ts, x.shape, x.dtype, "nvfp4", "1x16", 0), count
                data, scales, count = ext().mx_encode(x, fmt == "mxfp8", False, stochastic, seed & 0xFFFFFFFF, 0,
                                                      True)
                return PackedTensor(data, scales, None, x.shape, x.dtype, fmt, "1x32", 0), count
            except (TypeError, RuntimeError) as e:  # the extension's signature moved: use the public path
                import warnings

                _fast_ok = False
                warnings.warn(f"fp4offload: activation packing falls back to quantize() ({e})", RuntimeWarning,
                              stacklevel=2)
    packed = quantize(src, fmt, nonfinite="propagate", rounding="stochastic" if stochastic else "nearest", seed=seed)
    return packed, int((~torch.isfinite(src)).sum())


def encode(t: torch.Tensor, fmt: str, stochastic: bool = False,
           seed: int = 0) -> tuple[dict[str, torch.Tensor], Layout]:
    """Compress `t` (or take it as is for ``fmt="none"``; round fp32 to bf16 for ``"bf16"``).

    Returns the parts and their layout.
    """
    return encode_counted(t, fmt, stochastic, seed)[:2]


def encode_counted(t: torch.Tensor, fmt: str, stochastic: bool = False,
                   seed: int = 0) -> tuple[dict[str, torch.Tensor], Layout, int | torch.Tensor]:
    """:func:`encode`, and the count of non-finite values the codec met (quantize_counted's: an int, or an int64
    tensor on the source's device; 0 for ``"none"`` and ``"bf16"``, which keep Inf and NaN as they are)."""
    src = t.detach()
    count: int | torch.Tensor = 0
    if fmt == "none" or (fmt == "bf16" and src.dtype != torch.float32):
        parts, header = {"raw": src.contiguous()}, None
    elif fmt == "bf16":
        parts, header = {"raw": src.to(torch.bfloat16).contiguous()}, None
    else:
        packed, count = quantize_counted(src, fmt, stochastic, seed)
        parts, header = packed.tensors(), packed.header()
    spans, off = [], 0
    for name, p in parts.items():
        n = p.numel() * p.element_size()
        spans.append((name, p.dtype, tuple(p.shape), off, n))
        off += -(-n // ALIGN) * ALIGN
    return parts, Layout(src.shape, tuple(src.stride()), src.dtype, fmt, header, spans), count


def as_bytes(p: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view."""
    return p.reshape(-1).view(torch.uint8)


def write_parts(parts: dict[str, torch.Tensor], layout: Layout, buf: torch.Tensor, non_blocking: bool = False):
    """Copy the parts into a flat uint8 buffer at their offsets."""
    for name, _, _, off, n in layout.spans:
        if n:
            buf[off:off + n].copy_(as_bytes(parts[name]), non_blocking=non_blocking)


def read_parts(buf: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Views of the parts inside a flat uint8 buffer (no copy)."""
    return {name: buf[off:off + n].view(dtype).view(shape) for name, dtype, shape, off, n in layout.spans}


def decode(parts: dict[str, torch.Tensor], layout: Layout, *, copy: bool) -> torch.Tensor:
    """Rebuild the tensor (same shape, dtype and strides) on the parts' device.

    `copy` makes sure the result owns its memory when the parts are views of a buffer that will be
    reused (for ``fmt="none"`` nothing else would copy).
    """
    if layout.fmt in ("none", "bf16"):
        out = parts["raw"].view(layout.shape)
        if out.dtype != layout.dtype:
            out = out.to(layout.dtype)
        elif copy and out.stride() == layout.stride:
            out = out.clone()
    else:
        h = layout.header
        packed = PackedTensor(parts["data"], parts["scales"], parts.get("tensor_scale"), layout.shape, layout.dtype,
                              h["format"], h["block"], h["scale_scope"])
        out = dequantize(packed)
    if out.stride() != layout.stride and out.numel() > 1:
        strided = torch.empty_strided(layout.shape, layout.stride, dtype=layout.dtype, device=out.device)
        strided.copy_(out)
        out = strided
    return out
