"""The file store of FP4AdamW's NVMe tier: one file per (tensor key, segment), read ahead and written behind,
in generations that a step switches in whole or not at all.

Keys: a file is named by the key of the tensor it belongs to (``<key>.s<segment>.fp4s``), not by the
tensor's position in ``param_groups``: FP4AdamW's NVMe tier (tiers.NvmeTier) gives every tensor a key the
first time it steps it (the caller's ``tensor_key(tensor)`` when given and not None, else ``t<n>`` in order
of first use) and keeps it as long as the tensor lives, so a caller that swaps tensors in and out of its
param groups (DeepSpeed ZeRO-3 steps one sub-group at a time, each alone in its group) still finds each
tensor's own files.

File layout: fp4offload's container (fp4offload/formats/container.py: magic, format version, a checksummed
JSON header with the shape, dtype, offset and CRC32 of every tensor, then the raw bytes) holding the six
tensors of one segment (``m_codes``, ``m_scales``, ``m_tscale``, ``v_codes``, ``v_scales``, ``v_tscale``;
in a store made with ``residuals=True``, ``FP4AdamW(master="split", master_device="nvme")``, also split's
residual of the segment: ``master_lo``, ``master_odd_bits``, see state.Residual) and in the header the
segment's identity (key, segment number, element count, v format) and where it stands: the tensor's ``step``
count the states belong to, the store's generation ``gen`` that wrote it and the store's ``run`` id (random,
one per store). Files are created with mode 0600 in a folder of mode 0700. (No fsync by default: the tier
lives as long as the optimizer and is rebuilt from a checkpoint after a crash; ``fsync=True`` adds it.)

Generations (the all-or-nothing step): the store remembers, per key, the record of its files (generation,
step, element count, v format; generation 0: a fresh tensor whose states are zeros and have no file yet).
Every write belongs to a transaction (:meth:`NvmeStore.begin` ... :meth:`commit` or :meth:`abort`; FP4AdamW
opens one per step, and one per tensor it loads). ``begin`` checks the free space for everything the
transaction will write (minus ``reserve_bytes``) and reserves it on the disk (a preallocated file that each
write shrinks by what it is about to use, so another writer on the disk cannot take it mid-step), and raises
CapacityError before anything is written. The transaction's segments go to new names (``.<key>.s<segment>
.g<gen>.fp4s``) beside the committed files, which stay as they are; ``commit`` renames the new generation
over them once every write of the step has landed, ``abort`` deletes it and restores the records. A write
that fails for space anyway (ENOSPC, EDQUOT, EFBIG) raises CapacityError; the caller aborts.

Reads check magic, version, identity, step, generation, run id, sizes and checksums against the record,
and raise CorruptionError naming the file and the segment: a damaged file, or an older (or another run's)
valid copy put in its place, is never used and never overwritten.

The folder: ``<nvme_path>/fp4adamw-XXXXXXXX/`` holds a lock file (``owner.lock``: pid, process start time,
host, user) while its store lives. It is removed by ``close()``, when the store is collected and at normal
interpreter exit. With ``keep=True`` it stays instead, marked with a ``KEEP`` file (never swept) and, once
closed, a ``manifest.json`` listing each key's step, size and v format; :func:`read_kept` reads it back as
state-dict entries. When a store starts it sweeps ``nvme_path`` for this user's folders whose owning process
is gone (killed, crashed) and removes them, each reported with a warning on the ``fp4offload.optim.nvme``
logger.

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
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import uuid
import warnings
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import NamedTuple

import torch

from .. import metrics
from ..config import NVME_IO_ENGINES
from ..errors import CapacityError, ConfigError, CorruptionError
from ..formats.container import read_container, write_container
from .checks import check_choice
from .nvme_aio import (ALIGN, TENSOR_ALIGN, LockedPool, aio_op, can_lock, locked_bytes, probe, read_file, round_up,
                       write_file)
from .reference_step import SEGMENT, Packed, empty_packed, packed_sizes
from .state import PACKED_KEYS, RESIDUAL_KEYS, Residual, residual_sizes

log = logging.getLogger("fp4offload.optim.nvme")

KIND = "fp4offload.optim.segment"
FOLDER_PREFIX = "fp4adamw-"
LOCK_NAME = "owner.lock"
KEEP_NAME = "KEEP"
MANIFEST_NAME = "manifest.json"
MANIFEST_KIND = "fp4offload.optim.nvme_folder"
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_HEADER_ALLOWANCE = 4096  # bytes of container header counted when checking free space
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,120}")
_SPACE_HINT = "free space on that disk, point nvme_path at a larger one, or use state_device='cpu'"


def segment_file_bytes(n: int, residual: bool = False) -> int:
    """Payload bytes of one segment file of n elements, with split's residual or without (the header adds well
    under 1 KiB)."""
    c, s, t = packed_sizes(n)
    return 2 * (c + s + t) + (sum(residual_sizes(n)) if residual else 0)


def segment_disk_bytes(n: int, residual: bool = False) -> int:
    """Disk space one segment file of n elements may take, on either engine (what a transaction reserves)."""
    tensors = len(PACKED_KEYS) + (len(RESIDUAL_KEYS) if residual else 0)
    return round_up(segment_file_bytes(n, residual) + tensors * TENSOR_ALIGN, ALIGN) + _HEADER_ALLOWANCE


def tensor_disk_bytes(n: int, residual: bool = False) -> int:
    """Disk space of the files of a tensor of n elements."""
    return sum(segment_disk_bytes(min(n, s0 + SEGMENT) - s0, residual) for s0 in range(0, n, SEGMENT))


def segments_of(n: int) -> int:
    return -(-n // SEGMENT)


class Record(NamedTuple):
    """What the store expects of a key's files: the generation that wrote them (0: none yet, the states
    are zeros), the tensor's step count they belong to, its element count and v format."""

    gen: int
    step: int
    numel: int
    v_format: str


# ---- the folder's lock, the sweep of abandoned folders, kept folders -----------------------------------------

def _start_time(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/<pid>/stat), to tell a reused pid; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096).decode("ascii", "replace")
        return raw[raw.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _lock_info() -> dict:
    return {"pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname(), "uid": os.getuid()}


def _owner_gone(info: dict) -> bool:
    """True when the process named by a lock file is gone (or its pid now belongs to another process)."""
    if info.get("host") != socket.gethostname():
        return False  # another machine's folder on a shared disk: not ours to judge
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    start = _start_time(pid)
    return start is not None and info.get("start") is not None and start != info["start"]


def _folder_bytes(folder: Path) -> int:
    total = 0
    for f in folder.iterdir():
        try:
            total += f.lstat().st_size
        except OSError:
            pass
    return total


def sweep(root) -> list[Path]:
    """Remove this user's state folders under `root` whose owning process is gone; returns them.

    A folder is removed only when it is a real directory (not a link) owned by this user, is not kept (no
    ``KEEP`` file) and its lock file names a process on this host that no longer runs. Each removal is
    logged as a warning on ``fp4offload.optim.nvme``."""
    root = Path(root)
    removed = []
    try:
        candidates = sorted(root.glob(FOLDER_PREFIX + "*"))
    except OSError:
        return removed
    for d in candidates:
        try:
            st = d.lstat()
            if not d.is_dir() or d.is_symlink() or st.st_uid != os.getuid() or (d / KEEP_NAME).exists():
                continue
            lock = d / LOCK_NAME
            if lock.is_symlink() or not lock.is_file() or lock.stat().st_size > 4096:
                continue  # no lock yet (a store starting), or not ours
            info = json.loads(lock.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict) or not _owner_gone(info):
            continue
        size = _folder_bytes(d)
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
            log.warning("fp4offload: removed the abandoned NVMe optimizer-state folder %s (%.1f MiB) of process %s, "
                        "which is gone", d, size / 2**20, info.get("pid"))
    return removed


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _Folder:
    """The store's folder and what releases it: threads, page-locked buffers, then the folder itself (or, when
    kept, its manifest). Called once: by close(), when the store is collected, or at interpreter exit."""

    def __init__(self, path: Path, keep: bool, run: str, records: dict, residuals: bool = False):
        self.path, self.keep, self.run, self.records, self.residuals = path, keep, run, records, residuals
        self.pool: ThreadPoolExecutor | None = None
        self.bufs: LockedPool | None = None
        self.steps: dict[str, int] = {}  # the optimizer's step counts, given at close (kept folders)

    def __call__(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.bufs is not None:
            self.bufs.close()
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for f in self.path.glob(".*"):  # uncommitted generations, reservations, temporaries
            f.unlink(missing_ok=True)
        keys = {k: {"step": int(self.steps.get(k, r.step)), "numel": r.numel, "v_format": r.v_format,
                    "segments": segments_of(r.numel)} for k, r in sorted(self.records.items()) if r.gen > 0}
        try:
            _write_json(self.path / MANIFEST_NAME, {"kind": MANIFEST_KIND, "run": self.run, "keys": keys,
                                                    "residuals": self.residuals})
        finally:
            (self.path / LOCK_NAME).unlink(missing_ok=True)


def read_kept(folder) -> dict[str, dict]:
    """The states of a folder kept with ``keep=True`` (``FP4AdamW(nvme_keep=True)``), after its store closed.

    Returns ``{key: entry}``, each entry an FP4AdamW state-dict entry (``step``, ``v_format`` and the six packed
    uint8 tensors; split's ``master_lo`` and ``master_odd`` too when the files hold the residual) that
    ``fp4offload.optim.load_param_states(opt, {tensor: entry})`` loads (with the bf16 parameters of that moment).
    Every file is checked (checksums, identity, run id); anything missing or not matching raises
    CorruptionError."""
    folder = Path(folder)
    mpath = folder / MANIFEST_NAME
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CorruptionError(mpath, "manifest is missing (the folder was not kept, or its store did not close)") \
            from None
    except (OSError, ValueError) as e:
        raise CorruptionError(mpath, f"unreadable manifest ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise CorruptionError(mpath, "not a kept NVMe state folder's manifest", expected=MANIFEST_KIND,
                              found=manifest.get("kind") if isinstance(manifest, dict) else type(manifest).__name__)
    residuals = bool(manifest.get("residuals", False))
    out = {}
    for key, info in manifest.get("keys", {}).items():
        if not _KEY_RE.fullmatch(str(key)):
            raise CorruptionError(mpath, f"bad key {key!r}")
        n, vf = int(info["numel"]), info["v_format"]
        parts = []
        for seg in range(segments_of(n)):
            path = folder / f"{key}.s{seg:05d}.fp4s"
            meta, t = read_container(path)
            m = min(n, (seg + 1) * SEGMENT) - seg * SEGMENT
            want = {"kind": KIND, "key": key, "segment": seg, "numel": m, "v_format": vf, "run": manifest.get("run")}
            got = {k: meta.get(k) for k in want}
            if got != want:
                raise CorruptionError(path, f"segment {seg} of tensor {key}: header does not match the manifest",
                                      expected=want, found=got)
            if residuals:
                _check_residual(path, f"segment {seg} of tensor {key}", t, m)
            parts.append(t)
        entry = {"step": torch.tensor(float(info["step"])), "v_format": vf}
        if residuals:  # the state dict's form: int16 residual and int64 positions, as bytes
            entry["master_lo"] = torch.cat([pt["master_lo"].reshape(-1) for pt in parts])
            odd = [Residual(pt["master_lo"].view(torch.int16), pt["master_odd_bits"]).odd() + s * SEGMENT
                   for s, pt in enumerate(parts)]
            entry["master_odd"] = torch.cat(odd).view(torch.uint8)
        for k in PACKED_KEYS:
            entry[k] = torch.cat([pt[k].reshape(-1) for pt in parts])
        out[key] = entry
    return out


def _check_residual(path: Path, where: str, t: dict, n: int) -> None:
    """The residual tensors of a segment file of n elements: present, of their sizes, no odd bit past the end."""
    for name, size in zip(RESIDUAL_KEYS, residual_sizes(n)):
        if name not in t:
            raise CorruptionError(path, f"{where}: the file holds no split residual (tensor {name!r} is missing), "
                                  "which this store keeps beside the states", expected=size, found=None)
        if t[name].numel() != size or t[name].dtype != torch.uint8:
            raise CorruptionError(path, f"{where}: tensor {name!r} has the wrong size", expected=size,
                                  found=t[name].numel())
    if n % 8 and int(t["master_odd_bits"][-1]) >> (n % 8):
        raise CorruptionError(path, f"{where}: odd positions past the segment's {n} elements")


# ---- a transaction's reservation ------------------------------------------------------------------------------

class _Reservation:
    """Disk space held for a transaction: a preallocated file that shrinks by what each write is about to use."""

    def __init__(self, path: Path, nbytes: int):
        self.path, self.left, self._lock = path, max(0, int(nbytes)), threading.Lock()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            if self.left:
                try:
                    os.posix_fallocate(self.fd, 0, self.left)
                except OSError as e:
                    if e.errno in _SPACE_ERRNOS:
                        raise
                    self.left = 0  # a file system without preallocation: the free-space check stands alone
        except BaseException:
            self.close()
            raise

    def release(self, nbytes: int) -> None:
        with self._lock:
            if self.fd is None or self.left == 0:
                return
            self.left = max(0, self.left - int(nbytes))
            os.ftruncate(self.fd, self.left)

    def close(self) -> None:
        with self._lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
                self.path.unlink(missing_ok=True)


class _Txn:
    def __init__(self, gen: int, reservation: _Reservation):
        self.gen, self.reservation = gen, reservation
        self.written: set[Path] = set()  # generation files this transaction started
        self.orig: dict[str, Record | None] = {}  # records before the transaction, of the keys it touched
        self.undo_fd: int | None = None
        self.undo_len = 0


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
        keep: keep the folder when the store closes (see the module docstring).
        residuals: every segment file also holds split's residual of the segment (``master_lo``,
            ``master_odd_bits``), read and written with the states (``FP4AdamW(master_device="nvme")``).
        aio_block_size, aio_queue_depth: DeepSpeed aio_handle settings (its defaults: 1 MiB, 8).
    """

    def __init__(self, root, *, threads: int = 4, reserve_bytes: int = 0, io: str = "auto", fsync: bool = False,
                 keep: bool = False, residuals: bool = False, aio_block_size: int = 1 << 20,
                 aio_queue_depth: int = 8):
        check_choice("nvme_io", io, NVME_IO_ENGINES)
        if not isinstance(keep, bool):
            raise ConfigError("nvme_keep", keep, "True or False")
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        self.swept = sweep(root)
        self.dir = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=root))
        os.chmod(self.dir, 0o700)
        self.run_id = uuid.uuid4().hex[:16]
        self.records: dict[str, Record] = {}
        self._max_segs: dict[str, int] = {}  # key -> how many segments its committed files have
        self._txn: _Txn | None = None
        self._next_gen = 1
        self.residuals = bool(residuals)
        self._folder = _Folder(self.dir, keep, self.run_id, self.records, self.residuals)
        self._finalizer = weakref.finalize(self, self._folder)
        try:
            _write_json(self.dir / LOCK_NAME, _lock_info())
            if keep:
                (self.dir / KEEP_NAME).write_text("kept: FP4AdamW(nvme_keep=True); remove the folder when done\n")
        except BaseException:
            self._finalizer()
            raise
        self.keep = keep
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
                self._folder.keep = False
                self._finalizer()
                raise
            if self.io_reason is None:
                self.io = "aio"
            elif io == "aio":
                self._folder.keep = False
                self._finalizer()
                raise ConfigError("nvme_io", "aio", "'auto' or 'threads' on this machine",
                                  f"DeepSpeed's async_io cannot be used here: {self.io_reason}")
            else:
                _warn_once(f"fp4offload: the NVMe tier uses its thread-pool I/O; DeepSpeed's async_io is not "
                           f"usable: {self.io_reason}")
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="fp4adamw-nvme")
        self._folder.pool, self._folder.bufs = self._pool, self._pool_bufs

    # ---- the aio engine (nvme_aio.py) ---------------------------------------------------------------------

    def _start_aio(self) -> str | None:
        """Load the op and probe a direct write and read in the folder; None on success, else why not."""
        op, why = aio_op()
        if op is None:
            return why
        why = can_lock(locked_bytes(self.max_pending_writes + 4, self.residuals))
        if why is not None:
            return why
        self._aio = op
        self._pool_bufs = LockedPool(self._handle())
        self._folder.bufs = self._pool_bufs
        why = probe(self._handle(), self._pool_bufs, self.dir)
        if why is not None:
            self._pool_bufs.close()
            self._aio, self._pool_bufs, self._local = None, None, threading.local()
            self._folder.bufs = None
        return why

    def _handle(self):
        h = getattr(self._local, "h", None)
        if h is None:
            h = self._local.h = self._aio.aio_handle(*self._aio_args)
        return h

    # ---- naming and space -------------------------------------------------------------------------------

    def path(self, key: str, seg: int) -> Path:
        """The committed file of segment `seg` of `key`."""
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"NVMe state key {key!r}: expected 1-120 characters of [A-Za-z0-9_-]")
        return self.dir / f"{key}.s{seg:05d}.fp4s"

    def gen_path(self, key: str, seg: int, gen: int) -> Path:
        """The file of segment `seg` of `key` written by generation `gen`, until it is committed."""
        return self.path(key, seg).with_name(f".{key}.s{seg:05d}.g{gen}.fp4s")

    def _read_path(self, key: str, seg: int, rec: Record) -> Path:
        txn = self._txn
        return self.gen_path(key, seg, rec.gen) if txn is not None and rec.gen == txn.gen else self.path(key, seg)

    def files(self, key: str) -> list[Path]:
        """The committed segment files of `key`, by segment."""
        self.path(key, 0)
        return sorted(self.dir.glob(f"{key}.s[0-9]*.fp4s"))

    def remove(self, key: str, first_segment: int = 0) -> None:
        """Delete the committed files of `key` from segment `first_segment` on (outside a transaction)."""
        for f in self.files(key):
            if int(f.name[len(key) + 2:-len(".fp4s")]) >= first_segment:
                f.unlink(missing_ok=True)
        self._max_segs[key] = min(self._max_segs.get(key, 0), first_segment)

    def free_bytes(self) -> int:
        """Bytes the store may still use: free space of the folder's file system minus reserve_bytes."""
        return shutil.disk_usage(self.dir).free - self.reserve_bytes

    def check_space(self, need: int, what: str) -> None:
        have = self.free_bytes()
        if need > have:
            raise CapacityError(f"NVMe optimizer states ({what}) in {self.dir}", need, max(have, 0),
                                "nothing was written; " + _SPACE_HINT)

    def _space_left(self, e: OSError) -> tuple[int, str]:
        """(bytes left, the failure in words) after a write failed for space (ENOSPC with free bytes left: the
        file system ran out of inodes)."""
        why = errno.errorcode.get(e.errno, str(e.errno))
        have = max(self.free_bytes(), 0)
        try:
            if e.errno == errno.ENOSPC and os.statvfs(self.dir).f_favail == 0:
                return 0, why + " (the file system has no free inodes left: see df -i)"
        except OSError:
            pass
        return have, why

    # ---- transactions -------------------------------------------------------------------------------------

    @property
    def in_transaction(self) -> bool:
        return self._txn is not None

    def begin(self, need: int, what: str, undo_file: bool = False) -> None:
        """Open a transaction that will write at most `need` bytes: checked and reserved now (CapacityError,
        with nothing written, when they do not fit); `undo_file`: create its undo file now too."""
        if self._txn is not None:
            raise RuntimeError("an NVMe state transaction is already open")
        need = int(need)
        self.check_space(need, what)
        gen = self._next_gen
        self._next_gen += 1
        try:
            res = _Reservation(self.dir / f".reserve.g{gen}", need)
            txn = _Txn(gen, res)
            try:
                if undo_file:
                    txn.undo_fd = os.open(self._undo_path(gen), os.O_RDWR | os.O_CREAT | os.O_EXCL |
                                          getattr(os, "O_NOFOLLOW", 0), 0o600)
            except BaseException:
                self._end(txn)
                raise
        except OSError as e:
            if e.errno not in _SPACE_ERRNOS:
                raise
            have, why = self._space_left(e)
            raise CapacityError(f"NVMe optimizer states ({what}) in {self.dir}", need, have,
                                f"reserving that space failed with {why}; nothing was written and every previous "
                                "state file is intact; " + _SPACE_HINT) from None
        self._txn = txn

    @property
    def generation(self) -> int | None:
        """The open transaction's generation (None outside one)."""
        return None if self._txn is None else self._txn.gen

    def set_record(self, key: str, rec: Record | None) -> None:
        """Change the record of `key`; inside a transaction the previous one comes back on abort."""
        if self._txn is not None:
            self._txn.orig.setdefault(key, self.records.get(key))
        if rec is None:
            self.records.pop(key, None)
        else:
            self.records[key] = rec

    def commit(self) -> None:
        """Wait for the transaction's writes (re-raising the first failure: then call abort), then switch its
        generation in: rename its files over the committed ones and delete what the old records had beyond."""
        self.wait_writes()
        txn, self._txn = self._txn, None
        if txn is None:
            return
        try:
            for key in txn.orig:
                rec = self.records.get(key)
                now = 0 if rec is None or rec.gen == 0 else segments_of(rec.numel)
                if rec is not None and rec.gen == txn.gen:
                    for s in range(now):
                        os.replace(self.gen_path(key, s, txn.gen), self.path(key, s))
                for s in range(now, self._max_segs.get(key, 0)):  # segments the key's new record does not have
                    self.path(key, s).unlink(missing_ok=True)
                self._max_segs[key] = now
        except OSError as e:
            raise CorruptionError(self.dir, f"switching in generation {txn.gen} failed ({e}); the state files are "
                                  "now inconsistent (reads will say so)") from None
        finally:
            for p in txn.written:  # files of generations replaced within the transaction
                p.unlink(missing_ok=True)
            self._end(txn)

    def abort(self) -> None:
        """Drop the open transaction: wait for its writes (ignoring failures), delete its files, restore the
        records of the keys it touched. The committed files are as they were before it began."""
        txn = self._txn
        if txn is None:
            return
        try:
            self.wait_writes()
        except BaseException:
            pass
        self._txn = None
        for p in txn.written:
            p.unlink(missing_ok=True)
        for key, orig in txn.orig.items():
            if orig is None:
                self.records.pop(key, None)
            else:
                self.records[key] = orig
        self._end(txn)

    def _end(self, txn: _Txn) -> None:
        txn.reservation.close()
        if txn.undo_fd is not None:
            os.close(txn.undo_fd)
            txn.undo_fd = None
            self._undo_path(txn.gen).unlink(missing_ok=True)

    # ---- the undo file of a transaction (the weights it changed, beyond what RAM holds for it) -----------------

    def _undo_path(self, gen: int) -> Path:
        return self.dir / f".undo.g{gen}"

    def undo_append(self, data: memoryview) -> int:
        """Append bytes to the open transaction's undo file (space from its reservation); returns the offset."""
        txn = self._txn
        if txn is None:
            raise RuntimeError("no NVMe state transaction is open")
        n = data.nbytes
        off, done = txn.undo_len, 0
        try:
            if txn.undo_fd is None:
                txn.undo_fd = os.open(self._undo_path(txn.gen), os.O_RDWR | os.O_CREAT | os.O_EXCL |
                                      getattr(os, "O_NOFOLLOW", 0), 0o600)
            txn.reservation.release(round_up(n, ALIGN))
            while done < n:
                done += os.pwrite(txn.undo_fd, data[done:], off + done)
        except OSError as e:
            if e.errno not in _SPACE_ERRNOS:
                raise
            have, why = self._space_left(e)
            raise CapacityError(f"NVMe optimizer states (the step's undo log) in {self.dir}", n, have,
                                f"saving the old weights failed with {why}; the step is undone; " + _SPACE_HINT) \
                from None
        txn.undo_len += n
        return off

    def undo_read(self, offset: int, out: memoryview) -> None:
        """Read back bytes of the open transaction's undo file into `out`."""
        txn = self._txn
        done = 0
        while done < out.nbytes:
            got = os.preadv(txn.undo_fd, [out[done:]], offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"undo file {self._undo_path(txn.gen)} is short")
            done += got

    # ---- one segment ------------------------------------------------------------------------------------

    def _meta(self, key: str, seg: int, rec: Record) -> dict:
        return {"kind": KIND, "key": key, "segment": seg, "numel": min(rec.numel, (seg + 1) * SEGMENT) - seg * SEGMENT,
                "v_format": rec.v_format, "step": int(rec.step), "gen": int(rec.gen), "run": self.run_id}

    def _write(self, key: str, seg: int, n: int, v_format: str, step: int, m: Packed, v: Packed,
               res: Residual | None = None) -> int:
        txn = self._txn
        if txn is None:
            raise RuntimeError("NVMe state files are written inside a transaction (NvmeStore.begin)")
        if (res is None) == self.residuals:
            raise RuntimeError(f"segment {seg} of tensor {key}: a split residual is written exactly when the store "
                               f"keeps residuals ({self.residuals})")
        tensors = dict(zip(PACKED_KEYS, (*m, *v)))
        if res is not None:
            tensors.update(zip(RESIDUAL_KEYS, (res.lo.view(torch.uint8), res.bits)))
        meta = {"kind": KIND, "key": key, "segment": seg, "numel": n, "v_format": v_format, "step": int(step),
                "gen": txn.gen, "run": self.run_id}
        path = self.gen_path(key, seg, txn.gen)
        need = segment_disk_bytes(n, self.residuals)
        what = f"segment {seg} of tensor {key}"
        txn.written.add(path)
        try:
            txn.reservation.release(need)
            if self.io == "aio":
                tmp = path.with_name(f"{path.name}.tmp{uuid.uuid4().hex[:12]}")
                written = write_file(self._handle(), self._pool_bufs, path, tmp, meta,
                                     {k: t.detach().contiguous().cpu() for k, t in tensors.items()}, self.fsync)
            else:
                written = write_container(path, meta, tensors, fsync=self.fsync)  # temporary name, rename; 0600
        except OSError as e:
            if e.errno in _SPACE_ERRNOS:
                have, why = self._space_left(e)
                raise CapacityError(f"NVMe optimizer states ({what}) in {self.dir}", need, have,
                                    f"the write failed with {why}; the previous state file is intact and the step "
                                    "is undone; " + _SPACE_HINT) from None
            raise
        metrics.counter("optim.nvme.bytes_written").add(written)
        return written

    def _read(self, key: str, seg: int, n: int, v_format: str, copy: bool = False
              ) -> tuple[Packed, Packed, Residual | None]:
        rec = self.records.get(key)
        if rec is None:
            raise CorruptionError(self.path(key, seg), f"segment {seg} of tensor {key}: the store holds no states "
                                  "for this tensor")
        if rec.gen == 0:  # a fresh tensor: zero states (and residual), no file yet
            return empty_packed(n, "cpu"), empty_packed(n, "cpu"), Residual.zeros(n) if self.residuals else None
        path = self._read_path(key, seg, rec)
        where = f"segment {seg} of tensor {key}"
        try:
            got = read_file(self._handle(), self._pool_bufs, path, copy) if self.io == "aio" else None
            meta, t = got if got is not None else read_container(path)
        except CorruptionError as e:
            raise CorruptionError(path, f"{where}: {e.what}", offset=e.offset, expected=e.expected,
                                  found=e.found) from None
        try:
            want = self._meta(key, seg, rec)
            if n != want["numel"] or v_format != rec.v_format:
                raise CorruptionError(path, f"{where}: the optimizer asked for {n} elements in {v_format}, the "
                                      "store holds another layout", expected=(want["numel"], rec.v_format),
                                      found=(n, v_format))
            if not isinstance(meta, dict) or meta != want:
                raise CorruptionError(path, f"{where}: {_mismatch(meta, want)}", expected=want, found=meta)
            c, s, ts = packed_sizes(n)
            sizes = dict(zip(PACKED_KEYS, (c, s, ts, c, s, ts)))
            for name, size in sizes.items():
                if name not in t or t[name].numel() != size or t[name].dtype != torch.uint8:
                    raise CorruptionError(path, f"{where}: tensor {name!r} has the wrong size", expected=size,
                                          found=None if name not in t else t[name].numel())
            if self.residuals:
                _check_residual(path, where, t, n)
            extra = sorted(set(t) - set(sizes) - {"_pad", *(RESIDUAL_KEYS if self.residuals else ())})
            if extra:
                raise CorruptionError(path, f"{where}: unexpected tensors {extra}" + (
                    " (a split residual, which this store does not keep)" if set(extra) & set(RESIDUAL_KEYS) else ""))
        except CorruptionError:
            self._release(t)
            raise
        metrics.counter("optim.nvme.bytes_read").add(path.stat().st_size)
        res = Residual(t["master_lo"].view(torch.int16), t["master_odd_bits"]) if self.residuals else None
        return (Packed(t["m_codes"], t["m_scales"], t["m_tscale"]), Packed(t["v_codes"], t["v_scales"], t["v_tscale"]),
                res)

    def _release(self, tensors: dict[str, torch.Tensor]) -> None:
        if self._pool_bufs is not None and tensors:
            buf = self._pool_bufs.owner(next(iter(tensors.values())))
            if buf is not None:
                self._pool_bufs.put(buf)

    def release(self, m: Packed) -> None:
        """Hand back the page-locked buffer of a segment read with read_async that will not be written."""
        self._release({"m_codes": m.codes})

    # ---- asynchronous face ------------------------------------------------------------------------------

    def read_async(self, key: str, seg: int, n: int, v_format: str) -> Future:
        """Start reading a segment of the states `key`'s record names; the Future gives (m, v, residual) or
        raises CorruptionError (residual: the segment's Residual in a store that keeps them, else None).

        On the aio engine m, v and the residual are views of a page-locked buffer that stays the segment's until it
        is handed back with write_async (update them in place, then write them) or release.
        """
        return self._pool.submit(self._read, key, seg, n, v_format)

    def write_async(self, key: str, seg: int, n: int, v_format: str, step: int, m: Packed, v: Packed,
                    res: Residual | None = None) -> Future:
        """Start writing a segment into the open transaction's generation (the tensors must not change until
        the Future is done).

        Waits first while ``max_pending_writes`` writes are still running; failures are raised by wait_writes.
        """
        running = [f for f in self._pending if not f.done()]
        while len(running) >= self.max_pending_writes:
            wait(running, return_when=FIRST_COMPLETED)
            running = [f for f in running if not f.done()]
        fut = self._pool.submit(self._write, key, seg, n, v_format, step, m, v, res)
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

    def read(self, key: str, seg: int, n: int, v_format: str) -> tuple[Packed, Packed, Residual | None]:
        """Read a segment now; the tensors are the caller's (copies on the aio engine)."""
        return self._read(key, seg, n, v_format, copy=True)

    def write(self, key: str, seg: int, n: int, v_format: str, step: int, m: Packed, v: Packed,
              res: Residual | None = None) -> int:
        return self._write(key, seg, n, v_format, step, m, v, res)

    def bytes_on_disk(self) -> int:
        return sum(f.stat().st_size for f in self.dir.glob("*.fp4s"))

    def close(self, remove: bool = True, steps: dict[str, int] | None = None) -> None:
        """Wait for pending writes (an open transaction is aborted), stop the threads, free the aio buffers and
        delete the folder; with ``keep`` (or ``remove=False``) the folder stays with its manifest, `steps`
        (key -> the optimizer's step count) correcting the step each key's files were written at."""
        if not remove:
            self._folder.keep = True
        if steps:
            self._folder.steps.update(steps)
        try:
            if self._txn is not None:
                self.abort()
            self.wait_writes()
        finally:
            self._finalizer()


def _mismatch(found, want: dict) -> str:
    """Why a segment's header does not match what the store expects, in words."""
    if not isinstance(found, dict):
        return "header does not match"
    ident = ("kind", "key", "segment", "numel", "v_format")
    if any(found.get(k) != want[k] for k in ident):
        return "header does not match"
    if found.get("run") != want["run"]:
        return (f"header does not match: the file was written by another store (run {found.get('run')!r}, this one "
                f"is {want['run']!r}), not by this optimizer")
    if found.get("step") != want["step"] or found.get("gen") != want["gen"]:
        return (f"header does not match: a stale segment (step {found.get('step')}, generation {found.get('gen')}; "
                f"the optimizer expects step {want['step']}, generation {want['gen']})")
    return "header does not match"


_warned = False


def _warn_once(msg: str) -> None:
    global _warned
    log.warning(msg)
    if not _warned:
        _warned = True
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
