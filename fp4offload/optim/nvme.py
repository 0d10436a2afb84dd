"""The NVMe tier of FP4AdamW's states: one file per (parameter, segment), read ahead and written behind.

File layout: fp4offload's container (fp4offload/formats/container.py: magic, format version, a checksummed
JSON header with the shape, dtype, offset and CRC32 of every tensor, then the raw bytes), written and read
with that module's functions, holding the six tensors of one segment (``m_codes``, ``m_scales``,
``m_tscale``, ``v_codes``, ``v_scales``, ``v_tscale``) and the segment's identity (parameter number, segment
number, element count, v format) in the header. Files are written to a temporary name in the same folder,
fsynced and renamed over the old one, so a failed write leaves the previous state whole; they are created
with mode 0600 in a folder of mode 0700. (The fsync is not needed for a tier that lives as long as the
optimizer; an ``fsync=False`` switch in write_container would save it.)

Reads check magic, version, identity, sizes and checksums, and raise CorruptionError naming the file and
the segment; a damaged file is never overwritten (the step stops before the segment is used). Before
anything is written the store checks the free space of the folder (minus ``reserve_bytes``) and raises
CapacityError, and a write that still fails for space (ENOSPC, EDQUOT, EFBIG) removes its temporary file
and raises CapacityError: the old file stays.

I/O runs on a thread pool (``threads`` workers): the optimizer asks for segment s+1 while it updates
segment s and hands segment s back to be written while it updates s+1. DeepSpeed's async_io handle is
not used yet (see the module's notes in RESULTS.md): the thread pool is the path that always works.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .. import metrics
from ..errors import CapacityError, CorruptionError
from ..formats.container import read_container, write_container
from .reference_step import Packed, packed_sizes

KIND = "fp4offload.optim.segment"
_NAMES = ("m_codes", "m_scales", "m_tscale", "v_codes", "v_scales", "v_tscale")
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_HEADER_ALLOWANCE = 4096  # bytes of container header counted when checking free space


def segment_file_bytes(n: int) -> int:
    """Payload bytes of one segment file of n elements (the header adds well under 1 KiB)."""
    c, s, t = packed_sizes(n)
    return 2 * (c + s + t)


class NvmeStore:
    """Packed optimizer states in files under `root` (a private subfolder is created inside it)."""

    def __init__(self, root, *, threads: int = 4, reserve_bytes: int = 0):
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="fp4adamw-", dir=root))
        os.chmod(self.dir, 0o700)
        self.reserve_bytes = int(reserve_bytes)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="fp4adamw-nvme")
        self._pending: list[Future] = []

    # ---- naming and space -------------------------------------------------------------------------------

    def path(self, pid: int, seg: int) -> Path:
        return self.dir / f"p{pid:05d}_s{seg:05d}.fp4s"

    def free_bytes(self) -> int:
        """Bytes the store may still use: free space of the folder's file system minus reserve_bytes."""
        return shutil.disk_usage(self.dir).free - self.reserve_bytes

    def check_space(self, need: int, what: str) -> None:
        have = self.free_bytes()
        if need > have:
            raise CapacityError(f"NVMe optimizer states ({what}) in {self.dir}", need, max(have, 0),
                                "free space on that disk, point nvme_path at a larger one, or use "
                                "state_device='cpu'")

    # ---- one segment ------------------------------------------------------------------------------------

    def _write(self, pid: int, seg: int, n: int, v_format: str, m: Packed, v: Packed) -> int:
        tensors = dict(zip(_NAMES, (*m, *v)))
        meta = {"kind": KIND, "pid": pid, "segment": seg, "numel": n, "v_format": v_format}
        path = self.path(pid, seg)
        need = segment_file_bytes(n) + _HEADER_ALLOWANCE
        self.check_space(need, f"segment {seg} of parameter {pid}")
        try:
            written = write_container(path, meta, tensors, fsync=False)  # temporary name, rename; mode 0600
        except OSError as e:
            if e.errno in _SPACE_ERRNOS:
                raise CapacityError(f"NVMe optimizer states (segment {seg} of parameter {pid}) in {self.dir}",
                                    need, max(self.free_bytes(), 0),
                                    f"the write failed with {errno.errorcode.get(e.errno, e.errno)}; the previous "
                                    "state file is intact; free space or use state_device='cpu'") from None
            raise
        metrics.counter("optim.nvme.bytes_written").add(written)
        return written

    def _read(self, pid: int, seg: int, n: int, v_format: str) -> tuple[Packed, Packed]:
        path = self.path(pid, seg)
        where = f"segment {seg} of parameter {pid}"
        try:
            meta, t = read_container(path)
        except CorruptionError as e:
            raise CorruptionError(path, f"{where}: {e.what}", offset=e.offset, expected=e.expected,
                                  found=e.found) from None
        want = {"kind": KIND, "pid": pid, "segment": seg, "numel": n, "v_format": v_format}
        if meta != want:
            raise CorruptionError(path, f"{where}: header does not match", expected=want, found=meta)
        c, s, ts = packed_sizes(n)
        sizes = dict(zip(_NAMES, (c, s, ts, c, s, ts)))
        for name, size in sizes.items():
            if name not in t or t[name].numel() != size:
                raise CorruptionError(path, f"{where}: tensor {name!r} has the wrong size", expected=size,
                                      found=None if name not in t else t[name].numel())
        metrics.counter("optim.nvme.bytes_read").add(path.stat().st_size)
        return Packed(t["m_codes"], t["m_scales"], t["m_tscale"]), Packed(t["v_codes"], t["v_scales"], t["v_tscale"])

    # ---- asynchronous face ------------------------------------------------------------------------------

    def read_async(self, pid: int, seg: int, n: int, v_format: str) -> Future:
        """Start reading a segment; the Future gives (m, v) or raises CorruptionError."""
        return self._pool.submit(self._read, pid, seg, n, v_format)

    def write_async(self, pid: int, seg: int, n: int, v_format: str, m: Packed, v: Packed) -> Future:
        """Start writing a segment (the tensors must not change until the Future is done)."""
        fut = self._pool.submit(self._write, pid, seg, n, v_format, m, v)
        self._pending.append(fut)
        return fut

    def wait_writes(self) -> None:
        """Block until every write started so far is on disk; re-raise the first failure."""
        pending, self._pending = self._pending, []
        err = None
        for f in pending:
            try:
                f.result()
            except BaseException as e:  # keep waiting for the others, then raise the first
                err = err or e
        if err is not None:
            raise err

    def read(self, pid: int, seg: int, n: int, v_format: str) -> tuple[Packed, Packed]:
        return self._read(pid, seg, n, v_format)

    def write(self, pid: int, seg: int, n: int, v_format: str, m: Packed, v: Packed) -> int:
        return self._write(pid, seg, n, v_format, m, v)

    def bytes_on_disk(self) -> int:
        return sum(f.stat().st_size for f in self.dir.glob("*.fp4s"))

    def close(self, remove: bool = True) -> None:
        """Wait for pending writes, stop the threads and (by default) delete the folder."""
        try:
            self.wait_writes()
        finally:
            self._pool.shutdown(wait=True)
            if remove:
                shutil.rmtree(self.dir, ignore_errors=True)
