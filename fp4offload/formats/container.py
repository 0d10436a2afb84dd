"""fp4offload's file container: a JSON header, then raw tensor bytes, each with a CRC32.

Layout: ``MAGIC`` (8 bytes) | header length (uint64 little endian) | CRC32 of the header (uint32 little
endian) | header (UTF-8 JSON) | payload. The header holds ``version``, the caller's metadata and, per
tensor, dtype, shape, offset, nbytes and crc32; the file must end where the last tensor ends. Files are
written to a temporary name in the same folder, fsynced and renamed, so a crash leaves either the old file
or the new one; they are created readable by their owner only. Nothing is pickled.

Safety: the temporary file has a random name and is created exclusively (:func:`create_temp`), so a symlink or
a file planted at a predictable name cannot redirect a write or lend it its permissions. Reading opens the file
without blocking and reads only a regular file (a FIFO or a device is refused), checks the 20-byte prefix and
the header (at most ``MAX_HEADER_BYTES``, each key once, every entry's offset, size, shape and dtype) before the
payload is read, and :func:`verify_container` checks a file of any size in bounded memory.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Callable

import torch

from ..errors import CorruptionError
from .._jsonfile import DuplicateKeyError, file_kind, parse_json

MAGIC = b"FP4OFFL\x01"
VERSION = 1
_PREFIX = 8 + 8 + 4  # magic, header length, header crc32
#: a header is a few hundred bytes (4 KiB padded for direct I/O); a length past this is damage, not a header
MAX_HEADER_BYTES = 16 << 20
_CHUNK = 1 << 20
_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
           "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def create_temp(path) -> tuple[int, Path]:
    """A new, empty temporary file beside ``path`` for writing it: (fd open for writing, its path).

    The name is random (``.<name>.<random>.tmp``) and the file is created exclusively (``O_CREAT | O_EXCL``,
    and ``O_NOFOLLOW``, by :func:`tempfile.mkstemp`), so nothing planted beforehand, a symlink or a file with
    other permissions, is opened or written through; the mode is 0600 whatever the umask left. The caller
    writes, then ``os.replace``-s it onto ``path`` (which replaces a symlink there rather than following it).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, Path(tmp)


def write_container(path, meta: dict, tensors: dict[str, torch.Tensor], *, fsync: bool = True,
                    bind: Callable[[dict[str, int]], dict] | None = None) -> int:
    """Write `tensors` and `meta` to `path` atomically; returns the bytes written.

    `bind`, when given, is called with each tensor's CRC32 and returns more metadata to store (what
    PackedTensor.save ties its header to its payload with).

    The bytes go to a new temporary file of random name beside `path` (:func:`create_temp`: exclusive, 0600,
    not following a symlink), which is renamed onto `path` once complete.
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
    if bind is not None:
        meta = {**meta, **bind({k: e["crc32"] for k, e in entries.items()})}
    header = json.dumps({"version": VERSION, "meta": meta, "tensors": entries}, allow_nan=False).encode()
    fd, tmp = create_temp(path)
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


def _open(path: Path) -> tuple[int, int]:
    """(fd, size) of the regular file at `path`, opened without blocking; anything else is a CorruptionError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CorruptionError(path, "file is missing") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise CorruptionError(path, f"cannot be opened ({getattr(e, 'strerror', None) or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptionError(path, f"not a regular file ({file_kind(st.st_mode)}): not read")
    return fd, st.st_size


def _read_exact(fd: int, n: int, path: Path, offset: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, _CHUNK))
        if not b:
            raise CorruptionError(path, "file shrank while being read", offset=offset + got, expected=n, found=got)
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _header(path: Path, fd: int, size: int) -> tuple[dict, int, list[tuple[str, int, int, torch.dtype, list, int]]]:
    """Read and check the prefix and header at the start of `fd`: (meta, payload start, entries); each entry
    (name, absolute offset, nbytes, dtype, shape, crc32) is checked against itself and the file's size."""
    raw = _read_exact(fd, min(size, _PREFIX), path, 0)
    if len(raw) < _PREFIX or raw[:8] != MAGIC:
        raise CorruptionError(path, "not an fp4offload file (bad magic)", offset=0, expected=MAGIC, found=raw[:8])
    hlen, hcrc = struct.unpack("<QI", raw[8:_PREFIX])
    if hlen > MAX_HEADER_BYTES:
        raise CorruptionError(path, "header too large", offset=8, expected=f"at most {MAX_HEADER_BYTES}", found=hlen)
    if _PREFIX + hlen > size:
        raise CorruptionError(path, "truncated header", offset=_PREFIX, expected=hlen, found=size - _PREFIX)
    hraw = _read_exact(fd, hlen, path, _PREFIX)
    if zlib.crc32(hraw) != hcrc:
        raise CorruptionError(path, "header checksum mismatch", offset=_PREFIX, expected=f"{hcrc:#010x}",
                              found=f"{zlib.crc32(hraw):#010x}")
    try:
        header = parse_json(hraw.decode("utf-8"))
        version = header["version"]
        entries = header["tensors"]
        meta = header["meta"]
        if not isinstance(entries, dict) or not isinstance(meta, dict):
            raise TypeError("tensors and meta must be JSON objects")
    except DuplicateKeyError as e:
        raise CorruptionError(path, f"header names {e.key_path!r} {len(e.values)} times", offset=_PREFIX,
                              expected="each key once", found=e.values) from None
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise CorruptionError(path, f"unreadable header ({type(e).__name__}: {e})", offset=_PREFIX) from None
    if version != VERSION:
        raise CorruptionError(path, "unsupported format version", expected=VERSION, found=version)
    base = _PREFIX + hlen
    out = []
    for name, e in entries.items():
        try:
            off, n, crc, shape = e["offset"], e["nbytes"], e["crc32"], e["shape"]
            dtype = _DTYPES[e["dtype"]]
            if not (_count(off) and _count(n) and _count(crc) and isinstance(shape, list)
                    and all(_count(s) for s in shape)):
                raise ValueError("offset, nbytes, crc32 and shape must be non-negative integers")
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptionError(path, f"bad entry for tensor {name!r} ({type(err).__name__}: {err})",
                                  offset=_PREFIX) from None
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if math.prod(shape) * itemsize != n:
            raise CorruptionError(path, f"tensor {name!r} does not match its shape", offset=_PREFIX,
                                  expected=math.prod(shape) * itemsize, found=n)
        start = base + off
        if start + n > size:
            raise CorruptionError(path, f"tensor {name!r} truncated", offset=start, expected=n,
                                  found=max(size - start, 0))
        out.append((name, start, n, dtype, shape, crc))
    end = max([base] + [start + n for _, start, n, *_ in out])
    if end != size:
        raise CorruptionError(path, "unexpected bytes after the last tensor", offset=end, expected=end, found=size)
    return meta, base, out


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_entries(path) -> tuple[dict, dict[str, torch.Tensor], dict[str, int]]:
    """:func:`read_container` and the CRC32 of each tensor as the header gives it (checked)."""
    path = Path(path)
    fd, size = _open(path)
    try:
        meta, base, entries = _header(path, fd, size)
        payload = memoryview(_read_exact(fd, size - base, path, base))
    finally:
        os.close(fd)
    out, crcs = {}, {}
    for name, start, n, dtype, shape, want in entries:
        blob = payload[start - base:start - base + n]
        crc = zlib.crc32(blob)
        if crc != want:
            raise CorruptionError(path, f"checksum mismatch in tensor {name!r}", offset=start,
                                  expected=f"{want:#010x}", found=f"{crc:#010x}")
        t = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out[name], crcs[name] = t.view(dtype).reshape(shape), crc
    return meta, out, crcs


def read_container(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a container; any mismatch of magic, version, size or checksum raises CorruptionError.

    Only a regular file is read (a FIFO or a device is refused before a byte is read, without blocking), the
    header is read and checked before the payload, and the header may name each key once.
    """
    meta, tensors, _ = read_entries(path)
    return meta, tensors


def verify_container(path) -> tuple[dict, dict[str, dict]]:
    """Check a container as :func:`read_container` does, streaming the payload (memory bounded whatever the
    file's size): (meta, {tensor: {"dtype", "shape", "nbytes", "crc32"}}). What ``fp4offload inspect`` prints."""
    path = Path(path)
    fd, size = _open(path)
    try:
        meta, base, entries = _header(path, fd, size)
        out = {}
        for name, start, n, dtype, shape, want in sorted(entries, key=lambda e: e[1]):
            os.lseek(fd, start, os.SEEK_SET)
            crc, got = 0, 0
            while got < n:
                b = os.read(fd, min(n - got, _CHUNK))
                if not b:
                    raise CorruptionError(path, f"tensor {name!r} truncated", offset=start + got, expected=n,
                                          found=got)
                crc = zlib.crc32(b, crc)
                got += len(b)
            if crc != want:
                raise CorruptionError(path, f"checksum mismatch in tensor {name!r}", offset=start,
                                      expected=f"{want:#010x}", found=f"{crc:#010x}")
            out[name] = {"dtype": str(dtype).replace("torch.", ""), "shape": shape, "nbytes": n, "crc32": want}
    finally:
        os.close(fd)
    return meta, {name: out[name] for name, *_ in entries}
