"""PackedTensor: the bytes of a quantized tensor and what it takes to decode them.

Owns the container: its tensors, header, size check, file format (through ``container``) and device moves.
Its geometry (formats, the 2-D view, the sizes it must have) comes from ``layout``. Encoding, decoding and
the choice of backend belong to fp4offload/codec.py, which imports this module; this module imports nothing
from it. ``PackedTensor.dequantize`` calls the decoder codec.py installs with :func:`set_decoder` when it is
imported, which importing anything of fp4offload does first (the package's ``__init__`` imports codec).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .layout import FORMATS, packed_sizes, rows_cols

#: fp4offload.codec.dequantize, installed by fp4offload.codec (see set_decoder)
_decoder: Callable[["PackedTensor", "torch.dtype | None"], torch.Tensor] | None = None


def set_decoder(decode: Callable[["PackedTensor", "torch.dtype | None"], torch.Tensor]) -> None:
    """Install the function behind :meth:`PackedTensor.dequantize` (fp4offload.codec.dequantize)."""
    global _decoder
    _decoder = decode


@dataclass
class PackedTensor:
    """A tensor quantized to NVFP4, ufp4, MXFP4 or MXFP8 (see docs/design.md section 3).

    Attributes:
        data: uint8 codes. 4-bit formats hold two elements a byte, element 2i in the low nibble;
            MXFP8 one E4M3 byte an element. Padded to whole blocks (and to whole 16x16 tiles).
        scales: uint8 block scales: E4M3 bits (nvfp4, ufp4) or E8M0 bits (mxfp4, mxfp8).
        tensor_scale: fp32 decode scale per scope (nvfp4, ufp4), ``None`` for the MX formats.
        shape: shape of the source tensor.
        dtype: dtype of the source tensor (what ``dequantize()`` returns by default).
        format: ``"nvfp4" | "ufp4" | "mxfp4" | "mxfp8"``.
        block: ``"1x16" | "16x16" | "1x32"``.
        scale_scope: elements that share one tensor scale (0: the whole tensor).
    """

    data: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    shape: torch.Size
    dtype: torch.dtype
    format: str
    block: str
    scale_scope: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(int(s) for s in self.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + block scales + tensor scales."""
        n = self.data.numel() * self.data.element_size() + self.scales.numel()
        if self.tensor_scale is not None:
            n += self.tensor_scale.numel() * 4
        return n

    @property
    def rows_cols(self) -> tuple[int, int]:
        """The 2-D view tiles are taken over: (prod(shape[:-1]), shape[-1]) (``layout.rows_cols``)."""
        return rows_cols(self.shape)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``fp4offload.dequantize(self, dtype)``: the values in the source shape, as ``dtype`` (default: the
        source dtype), on this tensor's device."""
        return _decoder(self, dtype)

    def to(self, device, non_blocking: bool = False) -> "PackedTensor":
        ts = None if self.tensor_scale is None else self.tensor_scale.to(device, non_blocking=non_blocking)
        return PackedTensor(self.data.to(device, non_blocking=non_blocking),
                            self.scales.to(device, non_blocking=non_blocking), ts, self.shape, self.dtype,
                            self.format, self.block, self.scale_scope, dict(self.meta))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that make up this PackedTensor (for state dicts and files)."""
        out = {"data": self.data, "scales": self.scales}
        if self.tensor_scale is not None:
            out["tensor_scale"] = self.tensor_scale
        return out

    def header(self) -> dict:
        """JSON-able description (everything but the tensors)."""
        return {"format": self.format, "block": self.block, "shape": [int(s) for s in self.shape],
                "dtype": str(self.dtype).replace("torch.", ""), "scale_scope": int(self.scale_scope)}

    @classmethod
    def from_parts(cls, header: dict, tensors: dict[str, torch.Tensor]) -> "PackedTensor":
        from ..errors import ConfigError

        dtype = getattr(torch, header["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError("dtype", header["dtype"], "float32, bfloat16 or float16")
        if header["format"] not in FORMATS:
            raise ConfigError("format", header["format"], " | ".join(FORMATS))
        return cls(tensors["data"], tensors["scales"], tensors.get("tensor_scale"), torch.Size(header["shape"]),
                   dtype, header["format"], header["block"], int(header.get("scale_scope", 0)))

    def check(self) -> None:
        """Raise ValueError unless the tensors have the sizes the header implies (``layout.packed_sizes``)."""
        nbytes, nblocks, nscopes = packed_sizes(self.format, self.block, self.shape, self.scale_scope)
        if self.data.dtype != torch.uint8 or self.data.numel() != nbytes:
            raise ValueError(f"data holds {self.data.numel()} bytes, the shape needs {nbytes}")
        if self.scales.dtype != torch.uint8 or self.scales.numel() != nblocks:
            raise ValueError(f"scales hold {self.scales.numel()} bytes, the shape needs {nblocks}")
        if self.format in ("nvfp4", "ufp4"):
            if self.tensor_scale is None or self.tensor_scale.numel() != nscopes:
                raise ValueError(f"tensor_scale must hold {nscopes} fp32 value(s)")

    def save(self, path) -> None:
        """Write to `path` (temporary name, then rename) in fp4offload's checksummed container; no pickle."""
        from .container import write_container

        write_container(path, self.header(), self.tensors())

    @classmethod
    def load(cls, path, device="cpu") -> "PackedTensor":
        """Read a file written by `save`; a damaged file raises CorruptionError."""
        from .container import read_container

        from ..errors import ConfigError, CorruptionError

        header, tensors = read_container(path)
        try:
            pt = cls.from_parts(header, tensors)
            pt.check()
        except (ConfigError, KeyError, TypeError, ValueError) as e:
            raise CorruptionError(path, f"not a valid PackedTensor ({e})") from None
        return pt if str(device) == "cpu" else pt.to(device)

    def __repr__(self) -> str:
        return (f"PackedTensor(format={self.format}, block={self.block}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, nbytes={self.nbytes}, device={self.device})")
