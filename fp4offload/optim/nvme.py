"""The file store of FP4AdamW's NVMe tier: one file per (tensor key, segment), read ahead and written behind.

Keys: a file is named by the key of the tensor it belongs to (``<key>.s<segment>.fp4s``), not by the
tensor's position in ``param_groups``: FP4AdamW's NVMe tier (tiers.NvmeTier) gives every tensor a key the
first time it steps it (the caller's ``tensor_key(tensor)`` when given and not None, else ``t<n>`` in order
of first use) and keeps it as long as the tensor lives, so a caller that swaps tensors in and out of its
param groups (DeepSpeed ZeRO-3 steps one sub-group at a time, each alone in its group) still finds each
tensor's own files.

File layout: fp4offload's container (fp4offload/formats/container.py: magic, format version, a checksummed
JSON header with the shape, dtype, offset and CRC32 of every tensor, then the raw bytes) holding the six
tensors of one segment (``m_codes``, ``m_scales``, ``m_tscale``, ``v_codes``, ``v_scales``, ``v_tscale``)
and the segment's identity (key, segment number, element count, v format) in the header. Files are written
to a temporary name in the same folder and renamed over the old one, so a failed write leaves the previous
state whole; they are created with mode 0600 in a folder of mode 0700. (No fsync by default: the tier lives
as long as the optimizer and is rebuilt from a checkpoint after a crash; ``fsync=True`` adds it.)

Reads check magic, version, identity, sizes and checksums, and raise CorruptionError naming the file and
the segment; a damaged file is never overwritten (the step stops before the segment is used). Before
anything is written the store checks the free space of the folder (minus ``reserve_bytes``) and raises
CapacityError, and a write that still fails for space (ENOSPC, EDQUOT, EFBIG) removes its temporary file
and raises CapacityError: the old file stays.

I/O engines (``io``): the optimizer asks for segment s+1 while it updates segment s and hands segment s
back to be written while it updates s+1; ``threads`` workers run those requests. What a worker does with
the bytes depends on the engine:

- ``"threads"``: buffered reads and writes through the container module (read_container/write_container).
- ``"aio"``: DeepSpeed's async_io handle (libaio, O_DIRECT; one handle per worker) on files in the same
  container laid out for direct I/O, read into and written from page-locked buffers that the step updates
  in place (see nvme_aio.py). A write preallocates its temporary file, so a full disk fails there, before
  any byte is written, as CapacityError.
- ``"auto"`` (default): aio when DeepSpeed's async_io op loads and a probe write/read works in the
  folder, else threads, with one warning saying why.

Pending writes are bounded (``2 * threads``): write_async waits for the oldest beyond that, so the memory
held by write-behind stays a few segments however large the parameter.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
import threading
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from .. import metrics
from ..config import NVME_IO_ENGINES
from ..errors import CapacityError, ConfigError, CorruptionError
from ..formats.container import read_container, write_container
from .checks import check_choice
from .nvme_aio import (ALIGN, TENSOR_ALIGN, LockedPool, aio_op, can_lock, locked_bytes, probe, read_file, round_up,
                       write_file)
from .reference_step import Packed, packed_sizes
from .state import PACKED_KEYS

log = logging.getLogger("fp4offload.optim.nvme")

KIND = "fp4offload.optim.segment"
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_HEADER_ALLOWANCE = 4096  # bytes of container header counted when checking free space
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,120}")


def segment_file_bytes(n: int) -> int:
    """Payload bytes of one segment file of n elements (the header adds well under 1 KiB)."""
    c, s, t = packed_sizes(n)
    return 2 * (c + s + t)


# ---- the store --------------------------------------------------------------------------------------------

class NvmeStore:
    """Packed optimizer states in files under `root` (a private subfolder is created inside it).

    Args:
        root: folder on the disk to use.
        threads: I/O workers (each with its own aio handle on the aio engine).
        reserve_bytes: free space of that disk left untouched.
        io: ``"auto"`` | ``"aio"`` | ``"threads"`` (see the module docstring). ``io`` after construction
            says which engine runs, ``io_reason`` why aio does not (None when it does).
        fsync: flush every file to stable storage before renaming it (default False).
        aio_block_size, aio_queue_depth: DeepSpeed aio_handle settings (its defaults: 1 MiB, 8).
    """

    def __init__(self, root, *, threads: int = 4, reserve_bytes: int = 0, io: str = "auto", fsync: bool = False,
                 aio_block_size: int = 1 << 20, aio_queue_depth: int = 8):
        check_choice("nvme_io", io, NVME_IO_ENGINES)
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="fp4adamw-", dir=root))
        os.chmod(self.dir, 0o700)
        self.reserve_bytes = int(reserve_bytes)
        self.fsync = bool(fsync)
        self.threads = max(1, int(threads))
        self.max_pending_writes = 2 * self.threads
        self._pending: list[Future] = []
        self._aio = None
        self._pool_bufs: LockedPool | None = None
        self._local = threading.local()
        self._aio_args = (int(aio_block_size), int(aio_queue_depth), False, True, 1)
        self.io, self.io_reason = "threads", None
        if io != "threads":
            try:
                self.io_reason = self._start_aio()
            except BaseException:
                shutil.rmtree(self.dir, ignore_errors=True)
                raise
            if self.io_reason is None:
                self.io = "aio"
            elif io == "aio":
                shutil.rmtree(self.dir, ignore_errors=True)
                raise ConfigError("nvme_io", "aio", "'auto' or 'threads' on this machine",
                                  f"DeepSpeed's async_io cannot be used here: {self.io_reason}")
            else:
                _warn_once(f"fp4offload: the NVMe tier uses its thread-pool I/O; DeepSpeed's async_io is not "
                           f"usable: {self.io_reason}")
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="fp4adamw-nvme")

    # ---- the aio engine (nvme_aio.py) ---------------------------------------------------------------------

    def _start_aio(self) -> str | None:
        """Load the op and probe a direct write and read in the folder; None on success, else why not."""
        op, why = aio_op()
        if op is None:
            return why
        why = can_lock(locked_bytes(self.max_pending_writes + 4))
        if why is not None:
            return why
        self._aio = op
        self._pool_bufs = LockedPool(self._handle())
        why = probe(self._handle(), self._pool_bufs, self.dir)
        if why is not None:
            self._pool_bufs.close()
            self._aio, self._pool_bufs, self._local = None, None, threading.local()
        return why

    def _handle(self):
        h = getattr(self._local, "h", None)
        if h is None:
            h = self._local.h = self._aio.aio_handle(*self._aio_args)
        return h

    # ---- naming and space -------------------------------------------------------------------------------

    def path(self, key: str, seg: int) -> Path:
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"NVMe state key {key!r}: expected 1-120 characters of [A-Za-z0-9_-]")
        return self.dir / f"{key}.s{seg:05d}.fp4s"

    def files(self, key: str) -> list[Path]:
        """The segment files of `key`, by segment."""
        self.path(key, 0)
        return sorted(self.dir.glob(f"{key}.s[0-9]*.fp4s"))

    def remove(self, key: str, first_segment: int = 0) -> None:
        """Delete the files of `key` from segment `first_segment` on."""
        for f in self.files(key):
            if int(f.name[len(key) + 2:-len(".fp4s")]) >= first_segment:
                f.unlink(missing_ok=True)

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

    def _write(self, key: str, seg: int, n: int, v_format: str, m: Packed, v: Packed) -> int:
        tensors = dict(zip(PACKED_KEYS, (*m, *v)))
        meta = {"kind": KIND, "key": key, "segment": seg, "numel": n, "v_format": v_format}
        path = self.path(key, seg)
        need = round_up(segment_file_bytes(n) + 6 * TENSOR_ALIGN, ALIGN) + _HEADER_ALLOWANCE
        what = f"segment {seg} of tensor {key}"
        self.check_space(need, what)
        try:
            if self.io == "aio":
                tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
                written = write_file(self._handle(), self._pool_bufs, path, tmp, meta,
                                     {k: t.detach().contiguous().cpu() for k, t in tensors.items()}, self.fsync)
            else:
                written = write_container(path, meta, tensors, fsync=self.fsync)  # temporary name, rename; 0600
        except OSError as e:
            if e.errno in _SPACE_ERRNOS:
                raise CapacityError(f"NVMe optimizer states ({what}) in {self.dir}",
                                    need, max(self.free_bytes(), 0),
                                    f"the write failed with {errno.errorcode.get(e.errno, e.errno)}; the previous "
                                    "state file is intact; free space or use state_device='cpu'") from None
            raise
        metrics.counter("optim.nvme.bytes_written").add(written)
        return written

    def _read(self, key: str, seg: int, n: int, v_format: str, copy: bool = False) -> tuple[Packed, Packed]:
        path = self.path(key, seg)
        where = f"segment {seg} of tensor {key}"
        try:
            got = read_file(self._handle(), self._pool_bufs, path, copy) if self.io == "aio" else None
            meta, t = got if got is not None else read_container(path)
        except CorruptionError as e:
            raise CorruptionError(path, f"{where}: {e.what}", offset=e.offset, expected=e.expected,
                                  found=e.found) from None
        try:
            want = {"kind": KIND, "key": key, "segment": seg, "numel": n, "v_format": v_format}
            if meta != want:
                raise CorruptionError(path, f"{where}: header does not match", expected=want, found=meta)
            c, s, ts = packed_sizes(n)
            sizes = dict(zip(PACKED_KEYS, (c, s, ts, c, s, ts)))
            for name, size in sizes.items():
                if name not in t or t[name].numel() != size or t[name].dtype != torch.uint8:
                    raise CorruptionError(path, f"{where}: tensor {name!r} has the wrong size", expected=size,
                                          found=None if name not in t else t[name].numel())
        except CorruptionError:
            self._release(t)
            raise
        metrics.counter("optim.nvme.bytes_read").add(path.stat().st_size)
        return Packed(t["m_codes"], t["m_scales"], t["m_tscale"]), Packed(t["v_codes"], t["v_scales"], t["v_tscale"])

    def _release(self, tensors: dict[str, torch.Tensor]) -> None:
        if self._pool_bufs is not None and tensors:
            buf = self._pool_bufs.owner(next(iter(tensors.values())))
            if buf is not None:
                self._pool_bufs.put(buf)

    # ---- asynchronous face ------------------------------------------------------------------------------

    def read_async(self, key: str, seg: int, n: int, v_format: str) -> Future:
        """Start reading a segment; the Future gives (m, v) or raises CorruptionError.

        On the aio engine m and v are views of a page-locked buffer that stays the segment's until it is
        handed back with write_async (update them in place, then write them).
        """
        return self._pool.submit(self._read, key, seg, n, v_format)

    def write_async(self, key: str, seg: int, n: int, v_format: str, m: Packed, v: Packed) -> Future:
        """Start writing a segment (the tensors must not change until the Future is done).

        Waits first while ``max_pending_writes`` writes are still running; failures are raised by wait_writes.
        """
        running = [f for f in self._pending if not f.done()]
        while len(running) >= self.max_pending_writes:
            wait(running, return_when=FIRST_COMPLETED)
            running = [f for f in running if not f.done()]
        fut = self._pool.submit(self._write, key, seg, n, v_format, m, v)
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

    def read(self, key: str, seg: int, n: int, v_format: str) -> tuple[Packed, Packed]:
        """Read a segment now; the tensors are the caller's (copies on the aio engine)."""
        return self._read(key, seg, n, v_format, copy=True)

    def write(self, key: str, seg: int, n: int, v_format: str, m: Packed, v: Packed) -> int:
        return self._write(key, seg, n, v_format, m, v)

    def bytes_on_disk(self) -> int:
        return sum(f.stat().st_size for f in self.dir.glob("*.fp4s"))

    def close(self, remove: bool = True) -> None:
        """Wait for pending writes, stop the threads, free the aio buffers and (by default) delete the folder."""
        try:
            self.wait_writes()
        finally:
            self._pool.shutdown(wait=True)
            if self._pool_bufs is not None:
                self._pool_bufs.close()
                self._pool_bufs = None
            if remove:
                shutil.rmtree(self.dir, ignore_errors=True)


_warned = False


def _warn_once(msg: str) -> None:
    global _warned
    log.warning(msg)
    if not _warned:
        _warned = True
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
