"""fp4offload's file container: a JSON header, then raw tensor bytes, each with a CRC32.

Layout: ``MAGIC`` (8 bytes) | header length (uint64 little endian) | CRC32 of the header (uint32 little
endian) | header (UTF-8 JSON) | payload. The header holds ``version``, the caller's metadata and, per
tensor, dtype, shape, offset, nbytes and crc32; the file must end where the last tensor ends. Files are
written to a temporary name in the same folder, fsynced and renamed, so a crash leaves either the old file
or the new one; they are created readable by their owner only. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import torch

from ..errors import CorruptionError

MAGIC = b"FP4OFFL\x01"
VERSION = 1
_PREFIX = 8 + 8 + 4  # magic, header length, header crc32
_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
           "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_container(path, meta: dict, tensors: dict[str, torch.Tensor], *, fsync: bool = True) -> int:
    """Write `tensors` and `meta` to `path` atomically; returns the bytes written.

    `fsync=False` skips the flush to stable storage (the rename still makes the swap atomic for readers):
    for scratch tiers rewritten every step, whose loss on power failure is recovered from a checkpoint.
    """
    path = Path(path)
    entries, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = _tensor_bytes(t)
        entries[name] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "offset": offset,
                         "nbytes": len(raw), "crc32": zlib.crc32(raw)}
        blobs.append(raw)
        offset += len(raw)
    header = json.dumps({"version": VERSION, "meta": meta, "tensors": entries}).encode()
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<QI", len(header), zlib.crc32(header)) + header)
            for raw in blobs:
                f.write(raw)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return _PREFIX + len(header) + offset


def read_container(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a container; any mismatch of magic, version, size or checksum raises CorruptionError."""
    path = Path(path)
    if not path.exists():
        raise CorruptionError(path, "file is missing")
    raw = path.read_bytes()
    if len(raw) < _PREFIX or raw[:8] != MAGIC:
        raise CorruptionError(path, "not an fp4offload file (bad magic)", offset=0, expected=MAGIC, found=raw[:8])
    hlen, hcrc = struct.unpack("<QI", raw[8:_PREFIX])
    if _PREFIX + hlen > len(raw):
        raise CorruptionError(path, "truncated header", offset=_PREFIX, expected=hlen, found=len(raw) - _PREFIX)
    hraw = raw[_PREFIX:_PREFIX + hlen]
    if zlib.crc32(hraw) != hcrc:
        raise CorruptionError(path, "header checksum mismatch", offset=_PREFIX, expected=f"{hcrc:#010x}",
                              found=f"{zlib.crc32(hraw):#010x}")
    try:
        header = json.loads(hraw)
        version = header["version"]
        entries = header["tensors"]
        meta = header["meta"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptionError(path, f"unreadable header ({type(e).__name__}: {e})", offset=_PREFIX) from None
    if version != VERSION:
        raise CorruptionError(path, "unsupported format version", expected=VERSION, found=version)
    base = _PREFIX + hlen
    out, end = {}, base
    for name, e in entries.items():
        try:
            start, n, dtype, shape = base + int(e["offset"]), int(e["nbytes"]), _DTYPES[e["dtype"]], list(e["shape"])
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptionError(path, f"bad entry for tensor {name!r} ({err})", offset=_PREFIX) from None
        if start + n > len(raw):
            raise CorruptionError(path, f"tensor {name!r} truncated", offset=start, expected=n,
                                  found=max(len(raw) - start, 0))
        blob = raw[start:start + n]
        crc = zlib.crc32(blob)
        if crc != e["crc32"]:
            raise CorruptionError(path, f"checksum mismatch in tensor {name!r}", offset=start,
                                  expected=f"{e['crc32']:#010x}", found=f"{crc:#010x}")
        t = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        try:
            out[name] = t.view(dtype).reshape(shape)
        except RuntimeError as err:
            raise CorruptionError(path, f"tensor {name!r} does not match its shape ({err})", offset=start) from None
        end = max(end, start + n)
    if end != len(raw):
        raise CorruptionError(path, "unexpected bytes after the last tensor", offset=end, expected=end,
                              found=len(raw))
    return meta, out
