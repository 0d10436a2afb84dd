"""The geometry of a packed tensor, counted once: its formats and blocks, its 2-D view and its sizes in bytes.

Owns:

- ``FORMATS``: every format and the blocks it allows.
- :func:`rows_cols`: the (rows, cols) view of a shape, rows = prod(shape[:-1]), cols = shape[-1], that 16x16
  tiles are taken over and that the kernels' encoders and decoders are called with.
- :func:`packed_sizes`: the bytes of codes, block scales and tensor scales one tensor packs into (the sizes
  every backend allocates and :meth:`PackedTensor.check` verifies).
- :func:`bytes_per_element`: the same per element, for capacity planning (fp4offload/planner).

Not here: where the codes sit in a byte (``reference.pack_nibbles`` and csrc/fp4_codec.h), encoding and
decoding (``reference`` and the backends of fp4offload._ops), the container (``packed.PackedTensor``), and
argument checking and backend dispatch (fp4offload/_codec.py, which imports this module, never the reverse).
It uses no torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

__all__ = ["FORMATS", "BLOCK_ELEMENTS", "PackedSizes", "rows_cols", "packed_sizes", "bytes_per_element"]

#: format name -> (allowed blocks, default block)
FORMATS: dict[str, tuple[tuple[str, ...], str]] = {
    "nvfp4": (("1x16", "16x16"), "1x16"),
    "ufp4": (("1x16",), "1x16"),
    "mxfp4": (("1x32",), "1x32"),
    "mxfp8": (("1x32",), "1x32"),
    "int2": (("1x16",), "1x16"),
}
#: elements that share one block scale byte
BLOCK_ELEMENTS = {"1x16": 16, "16x16": 256, "1x32": 32}
#: bits of one element's code
_CODE_BITS = {"nvfp4": 4, "ufp4": 4, "mxfp4": 4, "mxfp8": 8, "int2": 2}
#: the formats with fp32 tensor scales (one per scope); the MX formats have none
_TENSOR_SCALED = ("nvfp4", "ufp4", "int2")
#: the formats whose 1x16 blocks may have a tensor scale per scope (int2 has one for the whole tensor)
_SCOPED = ("nvfp4", "ufp4")
_FP32_BYTES = 4


class PackedSizes(NamedTuple):
    """What one tensor packs into: ``data`` code bytes (padded to whole blocks or tiles), ``scales`` block
    scale bytes, ``tensor_scales`` fp32 tensor scales (0 for the MX formats)."""

    data: int
    scales: int
    tensor_scales: int

    @property
    def nbytes(self) -> int:
        return self.data + self.scales + _FP32_BYTES * self.tensor_scales


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rows_cols(shape: Sequence[int]) -> tuple[int, int]:
    """The 2-D view of ``shape``: (prod(shape[:-1]), shape[-1]); a 0-d tensor is (1, 1)."""
    if len(shape) == 0:
        return 1, 1
    cols = int(shape[-1])
    return (math.prod(int(s) for s in shape) // cols if cols else 0), cols


def packed_sizes(fmt: str, block: str, shape: Sequence[int], scope: int = 0) -> PackedSizes:
    """The sizes of ``shape`` packed as ``fmt`` in ``block`` blocks, ``scope`` elements per tensor scale
    (0: one for the whole tensor; only 1x16 blocks of nvfp4/ufp4 have smaller scopes)."""
    _check(fmt, block, scope)
    bits = _CODE_BITS[fmt]
    if block == "16x16":  # tiles of the 2-D view, padded to whole tiles; codes row-major over the padded view
        rows, cols = rows_cols(shape)
        padded = _ceil_div(rows, 16) * 16 * _ceil_div(cols, 16) * 16
        return PackedSizes(padded * bits // 8, padded // BLOCK_ELEMENTS[block], 1)
    n = math.prod(int(s) for s in shape)
    nblocks = _ceil_div(n, BLOCK_ELEMENTS[block])
    nscopes = (max(_ceil_div(n, scope), 1) if scope else 1) if fmt in _TENSOR_SCALED else 0
    return PackedSizes(nblocks * BLOCK_ELEMENTS[block] * bits // 8, nblocks, nscopes)


def bytes_per_element(fmt: str, block: str | None = None, scope: int = 0) -> float:
    """Bytes one element takes in ``fmt`` (``block`` None: the format's default), the block scales and the
    tensor scales of ``scope`` elements included; with ``scope`` 0 (one tensor scale, however large the
    tensor) the tensor scale is left out, as it is for a large tensor.

    It is :func:`packed_sizes` of one scope (or of one block when ``scope`` is 0) over its elements, so the
    two cannot disagree: nvfp4 1x16 is 0.5625, nvfp4 16x16 0.50390625, mxfp4 0.53125, mxfp8 1.03125, int2 0.3125, nvfp4
    (or ufp4) 1x16 with one scale per 1024 elements 0.56640625.
    """
    block = FORMATS[fmt][1] if (block is None and fmt in FORMATS) else block
    _check(fmt, block, scope)
    n = scope or BLOCK_ELEMENTS[block]
    sizes = packed_sizes(fmt, block, (16, 16) if block == "16x16" else (n,), scope)
    return (sizes.nbytes if scope else sizes.nbytes - _FP32_BYTES * sizes.tensor_scales) / n


def _check(fmt: str, block: str | None, scope: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if block not in FORMATS[fmt][0]:
        raise ValueError(f"block {block!r} is not one of {', '.join(FORMATS[fmt][0])} for format {fmt!r}")
    if scope and (fmt not in _SCOPED or block != "1x16" or scope < 0 or scope % BLOCK_ELEMENTS[block]):
        raise ValueError(f"scope {scope!r}: per-scope tensor scales exist for 1x16 nvfp4/ufp4, in multiples of 16")
