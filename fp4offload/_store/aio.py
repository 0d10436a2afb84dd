"""The direct-I/O (``"aio"``) engine's core: DeepSpeed's async_io op and the direct-I/O layout of a container file.

Owns: loading DeepSpeed's async_io op (:func:`aio_op`), the probe of a folder (:func:`probe`), and the reads and
writes of one file (:func:`read_file`, :func:`write_file`) in page-locked buffers of a
:class:`~fp4offload._store.pinned.LockedPool`. The aio engine (engines.AioEngine) keeps one aio handle per worker
thread and hands it in.

The file is fp4offload's container (formats/container.py) laid out for direct I/O: the JSON header is padded with
spaces so the payload starts at 4096, each tensor starts on a 64-byte boundary (zero gaps), and a trailing zero
tensor ``_pad`` (checksummed like the others) makes the file a whole number of 4096-byte blocks, so read_container
still reads it. A read takes the whole file into a page-locked buffer in one request and checks it in memory
(the same checks as read_container, plus: the gaps must be zero); the tensors are views of that buffer, which a
caller may update in place and the write sends back as it is (no copy). A write preallocates the temporary file
(posix_fallocate: a full disk fails there, before any byte is written), lets aio fill it, checks its size, then
(fsync and) renames it in Python. The temporary is created exclusively (O_EXCL, O_NOFOLLOW: a name planted in the
folder is never written through). A file whose size is not a whole number of blocks (a thread-engine file, or a
damaged one) is left to read_container, and so is a file for which a bounded pool has no page-locked buffer.
DeepSpeed's handle does not report failed requests of a transfer; a silently failed write shows up as a
CorruptionError when the file is next read, never as wrong data.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import torch

from ..errors import CorruptionError
from ..formats.container import MAGIC, VERSION
from .pinned import LockedPool

_PREFIX = len(MAGIC) + 8 + 4  # the container's magic, header length (u64), header CRC32 (u32)
ALIGN = 4096  # direct-I/O block: header region, payload start and file size are multiples of it
TENSOR_ALIGN = 64  # each tensor of an aio file starts on this boundary (fp32 tensors are read as views)
_PAD = "_pad"
_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,  # the container's
           "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NoLockedBuffer(Exception):
    """A bounded LockedPool has no page-locked buffer for this write (nothing was written)."""


def round_up(x: int, a: int) -> int:
    return -(-x // a) * a


_aio_lock = threading.Lock()
_aio_cache: dict = {}


def aio_op():
    """(DeepSpeed's async_io module, None), or (None, why it is unavailable). Loaded once per process."""
    with _aio_lock:
        if "op" not in _aio_cache:
            try:
                from deepspeed.ops.op_builder import AsyncIOBuilder

                b = AsyncIOBuilder()
                if not b.is_compatible(verbose=False):
                    raise RuntimeError("AsyncIOBuilder.is_compatible() is False (is libaio-dev installed?)")
                _aio_cache["op"] = (b.load(verbose=False), None)
            except BaseException as e:  # ImportError, a failed JIT build (SystemExit from ninja, ...)
                if isinstance(e, KeyboardInterrupt):
                    raise
                msg = str(e).strip().splitlines()
                _aio_cache["op"] = (None, f"{type(e).__name__}: {msg[0] if msg else ''}")
        return _aio_cache["op"]


def aio_layout(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Offsets (from the payload start) of the tensors of an aio file, given their bytes, and the payload's length."""
    offs, o = {}, 0
    for name, n in sizes.items():
        o = round_up(o, TENSOR_ALIGN)
        offs[name] = o
        o += n
    offs[_PAD] = o
    return offs, round_up(o, ALIGN)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def parse_image(path: Path, buf: torch.Tensor) -> tuple[dict, dict[str, torch.Tensor]]:
    """The checks of read_container on a file image in memory; tensors are views of `buf`."""
    a = buf.numpy()
    size = a.size
    if size < _PREFIX or bytes(a[:len(MAGIC)]) != MAGIC:
        raise CorruptionError(path, "not an fp4offload file (bad magic)", offset=0, expected=MAGIC,
                              found=bytes(a[:len(MAGIC)]))
    hlen, hcrc = struct.unpack("<QI", bytes(a[len(MAGIC):_PREFIX]))
    if _PREFIX + hlen > size:
        raise CorruptionError(path, "truncated header", offset=_PREFIX, expected=hlen, found=size - _PREFIX)
    hraw = bytes(a[_PREFIX:_PREFIX + hlen])
    if zlib.crc32(hraw) != hcrc:
        raise CorruptionError(path, "header checksum mismatch", offset=_PREFIX, expected=f"{hcrc:#010x}",
                              found=f"{zlib.crc32(hraw):#010x}")
    try:
        header = json.loads(hraw)
        version, entries, meta = header["version"], header["tensors"], header["meta"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptionError(path, f"unreadable header ({type(e).__name__}: {e})", offset=_PREFIX) from None
    if version != VERSION:
        raise CorruptionError(path, "unsupported format version", expected=VERSION, found=version)
    base = _PREFIX + hlen
    out, spans = {}, []
    for name, e in entries.items():
        try:
            start, n, dtype, shape = base + int(e["offset"]), int(e["nbytes"]), e["dtype"], list(e["shape"])
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptionError(path, f"bad entry for tensor {name!r} ({err})", offset=_PREFIX) from None
        if dtype not in _DTYPES or start < base:
            raise CorruptionError(path, f"bad entry for tensor {name!r}", offset=_PREFIX, expected="uint8",
                                  found=dtype)
        if start + n > size:
            raise CorruptionError(path, f"tensor {name!r} truncated", offset=start, expected=n,
                                  found=max(size - start, 0))
        crc = zlib.crc32(a[start:start + n])
        if crc != e["crc32"]:
            raise CorruptionError(path, f"checksum mismatch in tensor {name!r}", offset=start,
                                  expected=f"{e['crc32']:#010x}", found=f"{crc:#010x}")
        try:
            raw = buf[start:start + n]
            if dtype != "uint8":
                if math.prod(shape) * torch.empty(0, dtype=_DTYPES[dtype]).element_size() != n:
                    raise RuntimeError(f"{n} bytes")
                raw = raw.view(_DTYPES[dtype])
            out[name] = raw.reshape(shape)
        except (RuntimeError, TypeError) as err:
            raise CorruptionError(path, f"tensor {name!r} does not match its shape ({err})", offset=start) from None
        spans.append((start, start + n))
    end = max([base] + [s1 for _, s1 in spans])
    if end != size:
        raise CorruptionError(path, "unexpected bytes after the last tensor", offset=end, expected=end, found=size)
    pos = base
    for s0, s1 in sorted(spans):  # bytes no checksum covers must be zero
        if s0 > pos and a[pos:s0].any():
            raise CorruptionError(path, "non-zero bytes between tensors", offset=pos)
        pos = max(pos, s1)
    return meta, out


def probe(handle, pool: LockedPool, folder: Path) -> str | None:
    """A direct write and read of one block in `folder`: None when both work, else why not."""
    path = folder / ".aio-probe"
    a, b = pool.get(ALIGN), pool.get(ALIGN)
    if a is None or b is None:
        for x in (a, b):
            if x is not None:
                pool.put(x)
        return "no page-locked memory is left for the probe (RLIMIT_MEMLOCK)"
    why = None
    try:
        a.copy_(torch.arange(ALIGN, dtype=torch.int32).to(torch.uint8))
        b.zero_()
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        if handle.sync_pwrite(a, str(path)) != 1 or os.stat(path).st_size != ALIGN:
            why = f"a direct (O_DIRECT) write to {folder} failed"
        elif handle.sync_pread(b, str(path)) != 1 or not torch.equal(a, b):
            why = f"a direct (O_DIRECT) read from {folder} failed"
    except OSError as e:
        why = f"the probe in {folder} failed ({e})"
    finally:
        path.unlink(missing_ok=True)
        pool.put(a)
        pool.put(b)
    return why


def write_file(handle, pool: LockedPool, path: Path, tmp: Path, meta: dict, tensors: dict[str, torch.Tensor],
               fsync: bool) -> int:
    """Write a file in the aio layout to `tmp`, then rename it to `path`; returns its size.

    `tensors`: contiguous CPU tensors of any container dtype. Tensors that are the views a read_file(copy=False)
    handed out are written from their buffer as they are. Raises NoLockedBuffer, before anything is written, when
    a bounded pool has no buffer for it."""
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    offs, payload = aio_layout(sizes)
    npad = payload - offs[_PAD]
    entries = {k: {"dtype": _dtype_name(t), "shape": list(t.shape), "offset": offs[k], "nbytes": sizes[k],
                   "crc32": zlib.crc32(_bytes(t).numpy())} for k, t in tensors.items()}
    entries[_PAD] = {"dtype": "uint8", "shape": [npad], "offset": offs[_PAD], "nbytes": npad,
                     "crc32": zlib.crc32(bytes(npad))}
    hj = json.dumps({"version": VERSION, "meta": meta, "tensors": entries}).encode()
    head = round_up(_PREFIX + len(hj), ALIGN)
    hj += b" " * (head - _PREFIX - len(hj))  # JSON allows trailing blanks; the CRC covers them
    total = head + payload
    owner = pool.owner(next(iter(tensors.values()))) if tensors else None
    in_place = owner is not None and owner.numel() == total and all(
        t.data_ptr() == owner.data_ptr() + head + offs[k] for k, t in tensors.items())
    buf = owner if in_place else pool.get(total)
    if buf is None:
        raise NoLockedBuffer(total)
    try:
        a = buf.numpy()
        a[:head] = np.frombuffer(MAGIC + struct.pack("<QI", len(hj), zlib.crc32(hj)) + hj, dtype=np.uint8)
        pos = head
        for k, t in tensors.items():
            s0 = head + offs[k]
            a[pos:s0] = 0
            if not in_place:
                buf[s0:s0 + sizes[k]].copy_(_bytes(t))
            pos = s0 + sizes[k]
        a[pos:total] = 0
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, total)  # a full disk fails here, before any byte is written
            finally:
                os.close(fd)
            if handle.sync_pwrite(buf, str(tmp)) != 1 or os.stat(tmp).st_size != total:
                raise OSError(errno.EIO, f"DeepSpeed async_io did not write {total} bytes to {tmp}")
            if fsync:
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    finally:
        pool.put(buf)
        if owner is not None and owner is not buf:
            pool.put(owner)
    return total


def read_file(handle, pool: LockedPool, path: Path, copy: bool) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """(meta, tensors) of a file through aio, or None when its size is not whole blocks or a bounded pool has no
    buffer for it (then read_container reads it). Without `copy` the tensors are views of a pool buffer, which
    stays taken until it is written back or released."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise CorruptionError(path, "file is missing") from None
    if size == 0 or size % ALIGN:
        return None
    buf = pool.get(size)
    if buf is None:
        return None
    keep = False
    try:
        if handle.sync_pread(buf, str(path)) != 1:
            raise OSError(errno.EIO, f"DeepSpeed async_io could not read {path}")
        meta, t = parse_image(path, buf)
        if copy:
            t = {k: v.clone() for k, v in t.items()}
        else:
            keep = True  # the views live in buf until the file is written back (or the store closes)
        return meta, t
    finally:
        if not keep:
            pool.put(buf)
