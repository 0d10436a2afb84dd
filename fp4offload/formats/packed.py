"""PackedTensor: the bytes of a quantized tensor and what it takes to decode them.

Owns the container: its tensors, header, size check, file format (through ``container``) and device moves.
Its geometry (formats, the 2-D view, the sizes it must have) comes from ``layout``. Encoding, decoding and
the choice of backend belong to fp4offload/_codec.py, which imports this module; this module imports nothing
from it. ``PackedTensor.dequantize`` calls the decoder codec.py installs with :func:`set_decoder` when it is
imported, which importing anything of fp4offload does first (the package's ``__init__`` imports codec).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from .layout import _TENSOR_SCALED, FORMATS, packed_sizes, rows_cols

#: the keys of a saved header (``binding``: see PackedTensor.save)
_HEADER_KEYS = ("format", "block", "shape", "dtype", "scale_scope", "binding")
#: dtypes a quantized tensor can come from (and decode to by default)
_SOURCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: fp4offload._codec.dequantize, installed by fp4offload._codec (see set_decoder)
_decoder: Callable[["PackedTensor", "torch.dtype | None"], torch.Tensor] | None = None


def set_decoder(decode: Callable[["PackedTensor", "torch.dtype | None"], torch.Tensor]) -> None:
    """Install the function behind :meth:`PackedTensor.dequantize` (fp4offload._codec.dequantize)."""
    global _decoder
    _decoder = decode


@dataclass
class PackedTensor:
    """A tensor quantized to NVFP4, ufp4, MXFP4 or MXFP8 (see docs/design.md section 3).

    Attributes:
        data: uint8 codes. 4-bit formats hold two elements a byte, element 2i in the low nibble;
            MXFP8 one E4M3 byte an element, int2 four 2-bit codes a byte. Padded to whole blocks (and to whole
            16x16 tiles).
        scales: uint8 block scales: E4M3 bits (nvfp4, ufp4, int2) or E8M0 bits (mxfp4, mxfp8).
        tensor_scale: fp32 decode scale per scope (nvfp4, ufp4; int2 has one), ``None`` for the MX formats.
        shape: shape of the source tensor.
        dtype: dtype of the source tensor (what ``dequantize()`` returns by default).
        format: ``"nvfp4" | "ufp4" | "mxfp4" | "mxfp8" | "int2"``.
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
        """A PackedTensor from a :meth:`header` and its :meth:`tensors`; a field that is not one of the allowed
        values, or a combination that does not exist (a block of another format, a scope on a format without
        one, a tensor scale on an MX format), raises ConfigError naming the field."""
        from ..errors import ConfigError

        if not isinstance(header, dict):
            raise ConfigError("header", type(header).__name__, "a dict of format, block, shape, dtype, scale_scope")
        unknown = sorted(set(header) - set(_HEADER_KEYS))
        if unknown:
            raise ConfigError(unknown[0], header[unknown[0]], "one of " + ", ".join(_HEADER_KEYS), "unknown key")
        fmt = header.get("format")
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise ConfigError("format", fmt, " | ".join(FORMATS))
        block = header.get("block")
        if not isinstance(block, str) or block not in FORMATS[fmt][0]:
            raise ConfigError("block", block, f"{' | '.join(FORMATS[fmt][0])} for format {fmt!r}")
        name = header.get("dtype")
        if not isinstance(name, str) or name not in _SOURCE_DTYPES:
            raise ConfigError("dtype", name, " | ".join(_SOURCE_DTYPES), "the dtype of a quantized source tensor")
        shape = header.get("shape")
        if not isinstance(shape, (list, tuple)) or not all(_count(s) for s in shape):
            raise ConfigError("shape", shape, "a list of non-negative integers")
        scope = header.get("scale_scope", 0)
        if not _count(scope):
            raise ConfigError("scale_scope", scope, "a non-negative integer")
        try:
            packed_sizes(fmt, block, shape, scope)
        except ValueError as e:
            raise ConfigError("scale_scope", scope, "0, or a multiple of 16 for 1x16 nvfp4/ufp4", str(e)) from None
        want = {"data", "scales"} | ({"tensor_scale"} if fmt in _TENSOR_SCALED else set())
        if set(tensors) != want:
            extra = sorted(set(tensors) ^ want)[0]
            raise ConfigError("tensors", sorted(tensors), " + ".join(sorted(want)) + f" for format {fmt!r}",
                              f"{extra!r} is {'extra' if extra in tensors else 'missing'}")
        return cls(tensors["data"], tensors["scales"], tensors.get("tensor_scale"), torch.Size(shape),
                   _SOURCE_DTYPES[name], fmt, block, int(scope))

    def check(self) -> None:
        """Raise ValueError unless the tensors have the dtypes and sizes the header implies (``layout.packed_sizes``):
        1-D uint8 codes and block scales, and for nvfp4/ufp4/int2 1-D fp32 tensor scales (none for the MX formats)."""
        nbytes, nblocks, nscopes = packed_sizes(self.format, self.block, self.shape, self.scale_scope)
        if self.data.dtype != torch.uint8 or self.data.dim() != 1 or self.data.numel() != nbytes:
            raise ValueError(f"data holds {self.data.numel()} bytes ({self.data.dtype}, {self.data.dim()}-D), "
                             f"the shape needs {nbytes} (uint8, 1-D)")
        if self.scales.dtype != torch.uint8 or self.scales.dim() != 1 or self.scales.numel() != nblocks:
            raise ValueError(f"scales hold {self.scales.numel()} bytes ({self.scales.dtype}, {self.scales.dim()}-D), "
                             f"the shape needs {nblocks} (uint8, 1-D)")
        if self.format in _TENSOR_SCALED:
            ts = self.tensor_scale
            if ts is None or ts.dtype != torch.float32 or ts.dim() != 1 or ts.numel() != nscopes:
                raise ValueError(f"tensor_scale must hold {nscopes} fp32 value(s) (1-D)")
        elif self.tensor_scale is not None:
            raise ValueError(f"format {self.format} has no tensor scale")

    def _binding(self, crcs: dict[str, int]) -> int:
        """CRC32 that ties the header's fields to the payload's checksums (see :meth:`save`)."""
        return _binding_of(self.header(), crcs)

    def save(self, path) -> None:
        """Write to `path` (a new temporary file of random name, then rename) in fp4offload's checksummed
        container; no pickle.

        Besides the header, the file holds ``binding``: a CRC32 over the header's fields and the payload's
        CRC32s, so a header edited afterwards (nvfp4 relabelled ufp4, another shape of the same size) is caught
        on load even when whoever edited it fixed the header's own checksum."""
        from .container import write_container

        self.check()
        write_container(path, self.header(), self.tensors(), bind=lambda crcs: {"binding": self._binding(crcs)})

    @classmethod
    def load(cls, path, device="cpu", *, unbound_ok: bool = False) -> "PackedTensor":
        """Read a file written by `save`; a damaged file raises CorruptionError.

        Beyond the container's checks (magic, version, checksums, sizes), the header is cross-checked: format,
        block, scale scope and dtype must be values that exist together, the tensors must have the sizes and
        dtypes they imply, and ``binding`` must match the header and the payload. A file without it (written by
        a version before the binding, or not by :meth:`save`) is refused unless ``unbound_ok=True``: then the
        other checks still apply, and saving it again binds it. The error names the field."""
        from .container import read_entries

        from ..errors import ConfigError, CorruptionError

        header, tensors, crcs = read_entries(path)
        found = header.get("binding")
        if found is None and unbound_ok:
            pass
        elif not _count(found):
            raise CorruptionError(path, "not a valid PackedTensor: header field 'binding' is missing or not an "
                                  "integer (not written by PackedTensor.save of this version; a file saved before "
                                  "the binding loads with PackedTensor.load(path, unbound_ok=True), and saving it "
                                  "again binds it)", expected="a CRC32", found=found)
        elif (now := _binding_of(header, crcs)) != found:
            field_, saved = _which_field(header, crcs, found, tensors)
            if field_ is None:
                raise CorruptionError(path, "not a valid PackedTensor: the header fields format, block, shape, "
                                      "dtype, scale_scope do not match the payload they were saved with "
                                      "(binding mismatch)", expected=f"{found:#010x}", found=f"{now:#010x}")
            raise CorruptionError(path, f"not a valid PackedTensor: header field {field_!r} was changed after the "
                                  "file was written (binding mismatch)", expected=saved, found=header.get(field_))
        try:
            pt = cls.from_parts({k: v for k, v in header.items() if k != "binding"}, tensors)
            pt.check()
        except ConfigError as e:
            raise CorruptionError(path, f"not a valid PackedTensor: header field {e.key!r} ({e})",
                                  expected=e.allowed, found=e.value) from None
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptionError(path, f"not a valid PackedTensor: the header's format, block, shape and "
                                  f"scale_scope do not fit its tensors ({e})") from None
        return pt if str(device) == "cpu" else pt.to(device)

    def __repr__(self) -> str:
        return (f"PackedTensor(format={self.format}, block={self.block}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, nbytes={self.nbytes}, device={self.device})")


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _binding_of(header: dict, crcs: dict[str, int]) -> int:
    """CRC32 of the header's fields (as saved: format, block, shape, dtype, scale_scope) and the payload's CRC32s."""
    doc = {k: header.get(k) for k in _HEADER_KEYS if k != "binding"}
    if doc["scale_scope"] is None:
        doc["scale_scope"] = 0  # absent means 0
    doc["tensors"] = {k: int(crcs[k]) for k in sorted(crcs)}
    try:
        return zlib.crc32(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    except (TypeError, ValueError):  # a value JSON cannot hold: it cannot be what was saved
        return -1


def _which_field(header: dict, crcs: dict[str, int], found: int,
                 tensors: dict[str, torch.Tensor]) -> tuple[str | None, object]:
    """The one header field whose other value makes the binding match: (field, value saved), or (None, None)
    when no single field explains it. Scopes tried: 0 and those that give as many tensor scales as the file has."""
    scopes = [0]
    ts, shape = tensors.get("tensor_scale"), header.get("shape")
    if ts is not None and ts.numel() > 1 and isinstance(shape, list) and all(_count(x) for x in shape):
        n, k = math.prod(shape), ts.numel()
        first = -(-n // k)
        first = -(-first // 16) * 16
        scopes += [s for s in range(first, first + 16 * 256, 16) if -(-n // s) == k]
    others = {"format": list(FORMATS), "block": sorted({b for bs, _ in FORMATS.values() for b in bs}),
              "dtype": list(_SOURCE_DTYPES), "scale_scope": scopes}
    for name, values in others.items():
        for v in values:
            if v != header.get(name) and _binding_of({**header, name: v}, crcs) == found:
                return name, v
    return None, None
