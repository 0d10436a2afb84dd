"""The NVMe tier of FP4AdamW's states: one file per (tensor key, segment), read ahead and written behind.

Keys: a file is named by the key of the tensor it belongs to (``<key>.s<segment>.fp4s``), not by the
tensor's position in ``param_groups``: FP4AdamW gives every tensor a key the first time it steps it (the
caller's ``tensor_key(tensor)`` when given and not None, else ``t<n>`` in order of first use) and keeps it as
long as the tensor lives, so a caller that swaps tensors in and out of its param groups (DeepSpeed ZeRO-3
steps one sub-group at a time, each alone in its group) still finds each tensor's own files.

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
- ``"aio"``: DeepSpeed's async_io handle (libaio, O_DIRECT; one handle per worker). The file is the same
  container laid out for direct I/O: the JSON header is padded with spaces so the payload starts at 4096,
  each tensor starts on a 64-byte boundary (zero gaps), and a trailing zero tensor ``_pad`` (checksummed
  like the others) makes the file a whole number of 4096-byte blocks, so read_container still reads it. A
  read takes the whole file into a page-locked buffer in one request and checks it in memory (the same
  checks as read_container, plus: the gaps must be zero); the six tensors are views of that buffer, which
  the step updates in place and the write sends back as it is (no copy). A write preallocates the
  temporary file (posix_fallocate: a full disk fails there, before any byte is written, as CapacityError),
  lets aio fill it, checks its size, then (fsync and) renames it in Python. A file whose size is not a
  whole number of blocks (a thread-engine file, or a damaged one) is read through read_container.
  DeepSpeed's handle does not report failed requests of a transfer; a silently failed write shows up as a
  CorruptionError when the segment is next read, never as wrong states.
- ``"auto"`` (default): aio when DeepSpeed's async_io op loads and a probe write/read works in the
  folder, else threads, with one warning saying why.

Pending writes are bounded (``2 * threads``): write_async waits for the oldest beyond that, so the memory
held by write-behind stays a few segments however large the parameter.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import resource
import shutil
import struct
import tempfile
import threading
import warnings
import zlib
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from .. import metrics
from ..config import NVME_IO_ENGINES
from ..errors import CapacityError, ConfigError, CorruptionError
from ..formats.container import MAGIC, VERSION, read_container, write_container
from .checks import check_choice
from .reference_step import Packed, packed_sizes
from .state import PACKED_KEYS

log = logging.getLogger("fp4offload.optim.nvme")

KIND = "fp4offload.optim.segment"
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_HEADER_ALLOWANCE = 4096  # bytes of container header counted when checking free space
_PREFIX = len(MAGIC) + 8 + 4  # the container's magic, header length (u64), header CRC32 (u32)
ALIGN = 4096  # direct-I/O block: header region, payload start and file size are multiples of it
_TENSOR_ALIGN = 64  # each tensor of an aio file starts on this boundary (m_tscale is read as fp32)
_PAD = "_pad"
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,120}")


def segment_file_bytes(n: int) -> int:
    """Payload bytes of one segment file of n elements (the header adds well under 1 KiB)."""
    c, s, t = packed_sizes(n)
    return 2 * (c + s + t)


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


# ---- DeepSpeed's async_io op ------------------------------------------------------------------------------

_aio_lock = threading.Lock()
_aio_cache: dict = {}
_warned = False


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


def _can_lock(nbytes: int) -> str | None:
    """None when `nbytes` of page-locked memory can be had (DeepSpeed aborts the process when mlock fails)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:") and (int(line.split()[1], 16) >> 14) & 1:  # CAP_IPC_LOCK
                    return None
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= nbytes:
        return None
    return (f"RLIMIT_MEMLOCK is {soft} bytes, the aio engine's page-locked buffers need about {nbytes} "
            "(raise it with ulimit -l)")


class _LockedPool:
    """Page-locked, page-aligned uint8 buffers from DeepSpeed's pinned-tensor manager, reused by size."""

    def __init__(self, handle):
        self._h = handle
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._busy: dict[int, torch.Tensor] = {}  # data_ptr -> buffer handed out
        self._all: list[torch.Tensor] = []
        self._example = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                buf = free.pop()
            else:
                buf = self._h.new_cpu_locked_tensor(nbytes, self._example)
                self._all.append(buf)
            self._busy[buf.data_ptr()] = buf
            return buf

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._busy.pop(buf.data_ptr(), None) is not None:
                self._free.setdefault(buf.numel(), []).append(buf)

    def owner(self, t: torch.Tensor) -> torch.Tensor | None:
        """The handed-out buffer that `t` lies in, if any."""
        p = t.data_ptr()
        with self._lock:
            for base, buf in self._busy.items():
                if base <= p < base + buf.numel():
                    return buf
        return None

    def close(self) -> None:
        with self._lock:
            for buf in self._all:
                self._h.free_cpu_locked_tensor(buf)
            self._all, self._free, self._busy = [], {}, {}


def _aio_layout(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Offsets (from the payload start) of the tensors of an aio file and the payload's length."""
    offs, o = {}, 0
    for name, n in sizes.items():
        o = _round_up(o, _TENSOR_ALIGN)
        offs[name] = o
        o += n
    offs[_PAD] = o
    return offs, _round_up(o, ALIGN)


def _parse_image(path: Path, buf: torch.Tensor) -> tuple[dict, dict[str, torch.Tensor]]:
    """The checks of read_container on a file image in memory; tensors are views of `buf` (uint8 only)."""
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
        if dtype != "uint8" or start < base:
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
            out[name] = buf[start:start + n].reshape(shape)
        except RuntimeError as err:
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
        self._pool_bufs: _LockedPool | None = None
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

    # ---- the aio engine ---------------------------------------------------------------------------------

    def _start_aio(self) -> str | None:
        """Load the op and probe a direct write and read in the folder; None on success, else why not."""
        op, why = aio_op()
        if op is None:
            return why
        c, s, t = packed_sizes(1 << 20)
        need = (self.max_pending_writes + 4) * (ALIGN + _aio_layout(dict(zip(PACKED_KEYS, (c, s, t) * 2)))[1])
        why = _can_lock(need)
        if why is not None:
            return why
        self._aio = op
        h = self._handle()
        self._pool_bufs = _LockedPool(h)
        probe = self.dir / ".aio-probe"
        a, b = self._pool_bufs.get(ALIGN), self._pool_bufs.get(ALIGN)
        why = None
        try:
            a.copy_(torch.arange(ALIGN, dtype=torch.int32).to(torch.uint8))
            b.zero_()
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            if h.sync_pwrite(a, str(probe)) != 1 or os.stat(probe).st_size != ALIGN:
                why = f"a direct (O_DIRECT) write to {self.dir} failed"
            elif h.sync_pread(b, str(probe)) != 1 or not torch.equal(a, b):
                why = f"a direct (O_DIRECT) read from {self.dir} failed"
        except OSError as e:
            why = f"the probe in {self.dir} failed ({e})"
        finally:
            probe.unlink(missing_ok=True)
            self._pool_bufs.put(a)
            self._pool_bufs.put(b)
        if why is not None:
            self._pool_bufs.close()
            self._aio, self._pool_bufs, self._local = None, None, threading.local()
        return why

    def _handle(self):
        h = getattr(self._local, "h", None)
        if h is None:
            h = self._local.h = self._aio.aio_handle(*self._aio_args)
        return h

    def _write_aio(self, path: Path, tmp: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> int:
        pool = self._pool_bufs
        sizes = {k: t.numel() for k, t in tensors.items()}
        offs, payload = _aio_layout(sizes)
        npad = payload - offs[_PAD]
        entries = {k: {"dtype": "uint8", "shape": [sizes[k]], "offset": offs[k], "nbytes": sizes[k],
                       "crc32": zlib.crc32(tensors[k].numpy())} for k in tensors}
        entries[_PAD] = {"dtype": "uint8", "shape": [npad], "offset": offs[_PAD], "nbytes": npad,
                         "crc32": zlib.crc32(bytes(npad))}
        hj = json.dumps({"version": VERSION, "meta": meta, "tensors": entries}).encode()
        head = _round_up(_PREFIX + len(hj), ALIGN)
        hj += b" " * (head - _PREFIX - len(hj))  # JSON allows trailing blanks; the CRC covers them
        total = head + payload
        owner = pool.owner(tensors["m_codes"])
        in_place = owner is not None and owner.numel() == total and all(
            t.data_ptr() == owner.data_ptr() + head + offs[k] for k, t in tensors.items())
        buf = owner if in_place else pool.get(total)
        try:
            a = buf.numpy()
            a[:head] = np.frombuffer(MAGIC + struct.pack("<QI", len(hj), zlib.crc32(hj)) + hj, dtype=np.uint8)
            pos = head
            for k in tensors:
                s0 = head + offs[k]
                a[pos:s0] = 0
                if not in_place:
                    buf[s0:s0 + sizes[k]].copy_(tensors[k])
                pos = s0 + sizes[k]
            a[pos:total] = 0
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                try:
                    os.posix_fallocate(fd, 0, total)  # a full disk fails here, before any byte is written
                finally:
                    os.close(fd)
                if self._handle().sync_pwrite(buf, str(tmp)) != 1 or os.stat(tmp).st_size != total:
                    raise OSError(errno.EIO, f"DeepSpeed async_io did not write {total} bytes to {tmp}")
                if self.fsync:
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

    def _read_aio(self, path: Path, copy: bool) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """The file through aio, or None when its size is not whole blocks (then read_container reads it)."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CorruptionError(path, "file is missing") from None
        if size == 0 or size % ALIGN:
            return None
        buf = self._pool_bufs.get(size)
        keep = False
        try:
            if self._handle().sync_pread(buf, str(path)) != 1:
                raise OSError(errno.EIO, f"DeepSpeed async_io could not read {path}")
            meta, t = _parse_image(path, buf)
            if copy:
                t = {k: v.clone() for k, v in t.items()}
            else:
                keep = True  # the views live in buf until the segment is written back (or the store closes)
            return meta, t
        finally:
            if not keep:
                self._pool_bufs.put(buf)

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
        need = _round_up(segment_file_bytes(n) + 6 * _TENSOR_ALIGN, ALIGN) + _HEADER_ALLOWANCE
        what = f"segment {seg} of tensor {key}"
        self.check_space(need, what)
        try:
            if self.io == "aio":
                tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
                written = self._write_aio(path, tmp, meta, {k: t.detach().contiguous().cpu()
                                                             for k, t in tensors.items()})
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
            got = self._read_aio(path, copy) if self.io == "aio" else None
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


def _warn_once(msg: str) -> None:
    global _warned
    log.warning(msg)
    if not _warned:
        _warned = True
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
