"""The file store of FP4AdamW's NVMe tier: one file per (tensor key, segment), read ahead and written behind,
in generations that a step switches in whole or not at all, on the storage of fp4offload/_store.

Keys: a file is named by the key of the tensor it belongs to (``<key>.s<segment>.fp4s``), not by the
tensor's position in ``param_groups``: FP4AdamW's NVMe tier (tiers.NvmeTier) gives every tensor a key the
first time it steps it (the caller's ``tensor_key(tensor)`` when given and not None, else ``t<n>`` in order
of first use) and keeps it as long as the tensor lives, so a caller that swaps tensors in and out of its
param groups (DeepSpeed ZeRO-3 steps one sub-group at a time, each alone in its group) still finds each
tensor's own files.

:class:`NvmeStore` puts together the parts of fp4offload/_store and what the optimizer keeps in them:

- nvme_states.py (here): what a segment file holds (the six packed tensors, split's residual in a store with
  ``residuals``), its header (identity, step, generation, run id), its sizes and the checks every read makes
  against the key's :class:`Record`; a kept folder's manifest and :func:`read_kept`, which reads a kept folder
  back as state-dict entries.
- _store/segment.py: the segment file's names and the disk space it may take. Files are created with mode 0600 in
  a folder of mode 0700. (No fsync by default: the tier lives as long as the optimizer and is rebuilt from a
  checkpoint after a crash; ``fsync=True`` adds it.)
- _store/folder.py: the store's folder ``<nvme_path>/fp4adamw-XXXXXXXX/``: its lock file while the store lives,
  the sweep of this user's folders whose owning process is gone, ``keep=True`` (a ``KEEP`` mark and, once
  closed, the manifest).
- _store/txn.py: transactions (:meth:`NvmeStore.begin` ... :meth:`~NvmeStore.commit` or
  :meth:`~NvmeStore.abort`): the space of everything a transaction will write is checked and reserved up front
  (CapacityError before anything is written), its segments go to a new generation beside the committed files
  and are switched in whole on commit or deleted on abort; a step's undo file.
- _store/engines.py: the I/O engines (``io``: ``"threads"``, ``"aio"`` with DeepSpeed's async_io op as
  _store/aio.py drives it, or ``"auto"``) and the ``threads`` workers that read ahead and write behind, at most
  ``2 * threads`` writes pending.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from concurrent.futures import Future
from pathlib import Path

from .. import _metrics as metrics
from .._config import NVME_IO_ENGINES
from ..errors import ConfigError, CorruptionError
from .._store import folder as _folder
from .._store.aio import ALIGN, aio_op
from .._store.engines import Workers, start_engine
from .._store.folder import KEEP_NAME, LOCK_NAME
from .._store.pinned import LockedPool
from .._store.segment import gen_path, segment_files, segment_path
from .._store.txn import SPACE_ERRNOS, Transactions
from .checks import check_choice
from .nvme_states import (FOLDER_PREFIX, KIND, MANIFEST_KIND, MANIFEST_NAME, Record, StateFolder, check_segment,
                          expected_header, header, locked_bytes, read_kept, segment_disk_bytes, segment_file_bytes,
                          segment_tensors, segments_of, tensor_disk_bytes, unpack)
from .reference_step import Packed, empty_packed, v_bits
from .state import Residual

__all__ = ["ALIGN", "FOLDER_PREFIX", "KEEP_NAME", "KIND", "LOCK_NAME", "MANIFEST_KIND", "MANIFEST_NAME",
           "NvmeStore", "Record", "aio_op", "read_kept", "segment_disk_bytes", "segment_file_bytes", "segments_of",
           "sweep", "tensor_disk_bytes"]

log = logging.getLogger("fp4offload._optim.nvme")
SPACE_HINT = "free space on that disk, point nvme_path at a larger one, or use state_device='cpu'"


def sweep(root) -> list[Path]:
    """Remove this user's state folders under `root` whose owning process is gone; returns them.

    A folder is removed only when it is a real directory (not a link) owned by this user, is not kept (no
    ``KEEP`` file) and its lock file names a process on this host that no longer runs. Each removal is
    logged as a warning on ``fp4offload._optim.nvme``."""
    return _folder.sweep(root, FOLDER_PREFIX, "NVMe optimizer-state folder", log)


class NvmeStore:
    """Packed optimizer states in files under `root` (a private subfolder is created inside it).

    Args:
        root: folder on the disk to use.
        threads: I/O workers (each with its own aio handle on the aio engine).
        reserve_bytes: free space of that disk left untouched.
        io: ``"auto"`` | ``"aio"`` | ``"threads"`` (see _store/engines.py). ``io`` after construction
            says which engine runs, ``io_reason`` why aio does not (None when it does).
        fsync: flush every file to stable storage before renaming it (default False).
        keep: keep the folder when the store closes (see nvme_states.py and _store/folder.py).
        residuals: every segment file also holds split's residual of the segment (``master_lo``,
            ``master_odd_bits``), read and written with the states
            (``FP4AdamW(nvme=NvmeOptions(master_device="nvme"))``).
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
        self.run_id = uuid.uuid4().hex[:16]
        self.records: dict[str, Record] = {}
        self.residuals = bool(residuals)
        self._folder = StateFolder(root, keep, self.run_id, self.records, self.residuals)
        self.dir = self._folder.path
        self._finalizer = weakref.finalize(self, self._folder)
        try:
            self._folder.lock()
        except BaseException:
            self._finalizer()
            raise
        self.keep = keep
        self._txns = Transactions(self.dir, self.records, reserve_bytes, segments_of=segments_of,
                                  subject="NVMe optimizer states", hint=SPACE_HINT)
        self.fsync = bool(fsync)
        self.threads = max(1, int(threads))
        self.max_pending_writes = 2 * self.threads
        try:
            self._engine, self.io_reason = start_engine(io, self.dir,
                                                        locked_bytes(self.max_pending_writes + 4, self.residuals),
                                                        aio_block_size, aio_queue_depth, what="the NVMe tier",
                                                        logger=log)
        except BaseException:
            self._folder.keep = False
            self._finalizer()
            raise
        self.io = self._engine.name
        self._workers = Workers(self.threads)
        self._folder.closers = [self._workers.shutdown, self._engine.close]

    @property
    def reserve_bytes(self) -> int:
        """Free space of the disk left untouched."""
        return self._txns.reserve_bytes

    @reserve_bytes.setter
    def reserve_bytes(self, nbytes: int) -> None:
        self._txns.reserve_bytes = int(nbytes)

    @property
    def _pending(self) -> list[Future]:
        return self._workers.pending

    @property
    def _pool_bufs(self) -> LockedPool | None:
        """The aio engine's page-locked buffers (None on the thread engine)."""
        return self._engine.bufs

    # ---- naming and space -------------------------------------------------------------------------------

    def path(self, key: str, seg: int) -> Path:
        """The committed file of segment `seg` of `key`."""
        return segment_path(self.dir, key, seg)

    def gen_path(self, key: str, seg: int, gen: int) -> Path:
        """The file of segment `seg` of `key` written by generation `gen`, until it is committed."""
        return gen_path(self.dir, key, seg, gen)

    def files(self, key: str) -> list[Path]:
        """The committed segment files of `key`, by segment."""
        return segment_files(self.dir, key)

    def remove(self, key: str, first_segment: int = 0) -> None:
        """Delete the committed files of `key` from segment `first_segment` on (outside a transaction)."""
        self._txns.remove(key, first_segment)

    def free_bytes(self) -> int:
        """Bytes the store may still use: free space of the folder's file system minus reserve_bytes."""
        return self._txns.free_bytes()

    def check_space(self, need: int, what: str) -> None:
        self._txns.check_space(need, what)

    # ---- transactions (_store/txn.py) ------------------------------------------------------------------------

    @property
    def in_transaction(self) -> bool:
        return self._txns.current is not None

    @property
    def generation(self) -> int | None:
        """The open transaction's generation (None outside one)."""
        return self._txns.generation

    def begin(self, need: int, what: str, undo_file: bool = False) -> None:
        """Open a transaction that will write at most `need` bytes: checked and reserved now (CapacityError,
        with nothing written, when they do not fit); `undo_file`: create its undo file now too."""
        self._txns.begin(need, what, undo_file)

    def set_record(self, key: str, rec: Record | None) -> None:
        """Change the record of `key`; inside a transaction the previous one comes back on abort."""
        self._txns.set_record(key, rec)

    def commit(self) -> None:
        """Wait for the transaction's writes (re-raising the first failure: then call abort), then switch its
        generation in: rename its files over the committed ones and delete what the old records had beyond."""
        self.wait_writes()
        self._txns.commit()

    def abort(self) -> None:
        """Drop the open transaction: wait for its writes (ignoring failures), delete its files, restore the
        records of the keys it touched. The committed files are as they were before it began."""
        if self._txns.current is None:
            return
        try:
            self.wait_writes()
        except BaseException:
            pass
        self._txns.abort()

    def undo_append(self, data: memoryview) -> int:
        """Append bytes to the open transaction's undo file (space from its reservation); returns the offset."""
        return self._txns.undo_append(data)

    def undo_read(self, offset: int, out: memoryview) -> None:
        """Read back bytes of the open transaction's undo file into `out`."""
        self._txns.undo_read(offset, out)

    # ---- one segment ------------------------------------------------------------------------------------

    def _write(self, key: str, seg: int, n: int, v_format: str, step: int, m: Packed, v: Packed,
               res: Residual | None = None) -> int:
        txn = self._txns.current
        if txn is None:
            raise RuntimeError("NVMe state files are written inside a transaction (NvmeStore.begin)")
        if (res is None) == self.residuals:
            raise RuntimeError(f"segment {seg} of tensor {key}: a split residual is written exactly when the store "
                               f"keeps residuals ({self.residuals})")
        tensors = segment_tensors(m, v, res)
        meta = header(key, seg, n, v_format, step, txn.gen, self.run_id)
        path = self.gen_path(key, seg, txn.gen)
        need = segment_disk_bytes(n, self.residuals, v_bits(v_format))
        try:
            txn.claim(path, need)
            written = self._engine.write(path, meta, tensors, self.fsync)
        except OSError as e:
            if e.errno in SPACE_ERRNOS:
                raise self._txns.space_error(e, f"segment {seg} of tensor {key}", need, "the write failed with "
                                             "{why}; the previous state file is intact and the step is undone; "
                                             ) from None
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
            return (empty_packed(n, "cpu"), empty_packed(n, "cpu", v_bits(v_format)),
                    Residual.zeros(n) if self.residuals else None)
        path = self._txns.read_path(key, seg, rec)
        where = f"segment {seg} of tensor {key}"
        try:
            meta, t = self._engine.read(path, copy)
        except CorruptionError as e:
            raise CorruptionError(path, f"{where}: {e.what}", offset=e.offset, expected=e.expected,
                                  found=e.found) from None
        try:
            check_segment(path, where, meta, t, expected_header(key, seg, rec, self.run_id), n, v_format, rec,
                          self.residuals)
        except CorruptionError:
            self._engine.release(t)
            raise
        metrics.counter("optim.nvme.bytes_read").add(path.stat().st_size)
        return unpack(t, self.residuals)

    def release(self, m: Packed) -> None:
        """Hand back the page-locked buffer of a segment read with read_async that will not be written."""
        self._engine.release({"m_codes": m.codes})

    # ---- asynchronous face (_store/engines.py's workers) --------------------------------------------------

    def read_async(self, key: str, seg: int, n: int, v_format: str) -> Future:
        """Start reading a segment of the states `key`'s record names; the Future gives (m, v, residual) or
        raises CorruptionError (residual: the segment's Residual in a store that keeps them, else None).

        On the aio engine m, v and the residual are views of a page-locked buffer that stays the segment's until it
        is handed back with write_async (update them in place, then write them) or release.
        """
        return self._workers.read(self._read, key, seg, n, v_format)

    def write_async(self, key: str, seg: int, n: int, v_format: str, step: int, m: Packed, v: Packed,
                    res: Residual | None = None) -> Future:
        """Start writing a segment into the open transaction's generation (the tensors must not change until
        the Future is done).

        Waits first while ``max_pending_writes`` writes are still running; failures are raised by wait_writes.
        """
        return self._workers.write(self._write, key, seg, n, v_format, step, m, v, res)

    def wait_writes(self) -> None:
        """Block until every write started so far is on disk; re-raise the first failure."""
        self._workers.wait_writes()

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
            if self._txns.current is not None:
                self.abort()
            self.wait_writes()
        finally:
            self._finalizer()
