"""A store's transactions: space reserved up front, generations switched in whole or not at all, and the undo
file of a transaction.

Generations (the all-or-nothing step): the store remembers, per key, the record of its files (any object with a
generation ``gen`` and an element count ``numel``; generation 0: a key whose data are zeros and have no file yet).
Every write belongs to a transaction (:meth:`Transactions.begin` ... :meth:`~Transactions.commit` or
:meth:`~Transactions.abort`; FP4AdamW opens one per step, and one per tensor it loads). ``begin`` checks the free
space for everything the transaction will write (minus ``reserve_bytes``) and reserves it on the disk (a
preallocated file that each write shrinks by what it is about to use, so another writer on the disk cannot take
it mid-step), and raises CapacityError before anything is written. The transaction's segments go to new names
(``.<key>.s<segment>.g<gen>.fp4s``, segment.py) beside the committed files, which stay as they are; ``commit``
renames the new generation over them once every write has landed, ``abort`` deletes it and restores the
records. A write that fails for space anyway (ENOSPC, EDQUOT, EFBIG) raises CapacityError
(:meth:`~Transactions.space_error`); the caller aborts.

The undo file (``.undo.g<gen>``) holds what a transaction changed beyond what RAM holds for its undo, appended
with space from the transaction's reservation and read back when it is undone.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import CapacityError, CorruptionError
from .aio import ALIGN, round_up
from .segment import gen_path, segment_files, segment_of, segment_path

SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
SPACE_HINT = "free space on that disk or point the store at a larger one"


class Reservation:
    """Disk space held for a transaction: a preallocated file that shrinks by what each write is about to use."""

    def __init__(self, path: Path, nbytes: int):
        self.path, self.left, self._lock = path, max(0, int(nbytes)), threading.Lock()
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            if self.left:
                try:
                    os.posix_fallocate(self.fd, 0, self.left)
                except OSError as e:
                    if e.errno in SPACE_ERRNOS:
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


class Txn:
    """One open transaction: its generation, reservation, the files it started, the records it replaced, and
    its undo file."""

    def __init__(self, gen: int, reservation: Reservation):
        self.gen, self.reservation = gen, reservation
        self.written: set[Path] = set()  # generation files this transaction started
        self.orig: dict = {}  # records before the transaction, of the keys it touched
        self.undo_fd: int | None = None
        self.undo_len = 0

    def claim(self, path: Path, nbytes: int) -> None:
        """A write of this generation's file `path` is about to use `nbytes`: note the file, free the space."""
        self.written.add(path)
        self.reservation.release(nbytes)


class Transactions:
    """The records of the keys of a store's folder `folder` (`records`, shared with its owner) and the one
    transaction open at a time over them; `reserve_bytes` of the disk are left untouched.

    `segments_of(numel)`: how many segment files a record of `numel` elements has. `subject` names the store in a
    CapacityError (``"<subject> (<what>) in <folder>"``) and `hint` ends its message (what to do)."""

    def __init__(self, folder: Path, records: dict, reserve_bytes: int = 0, *,
                 segments_of: Callable[[int], int], subject: str = "NVMe files", hint: str = SPACE_HINT):
        self.dir, self.records, self.reserve_bytes = folder, records, int(reserve_bytes)
        self._segments_of, self.subject, self.hint = segments_of, subject, hint
        self.current: Txn | None = None
        self._max_segs: dict[str, int] = {}  # key -> how many segments its committed files have
        self._next_gen = 1

    # ---- space ----------------------------------------------------------------------------------------------

    def free_bytes(self) -> int:
        """Bytes the store may still use: free space of the folder's file system minus reserve_bytes."""
        return shutil.disk_usage(self.dir).free - self.reserve_bytes

    def check_space(self, need: int, what: str) -> None:
        have = self.free_bytes()
        if need > have:
            raise CapacityError(f"{self.subject} ({what}) in {self.dir}", need, max(have, 0),
                                "nothing was written; " + self.hint)

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

    def space_error(self, e: OSError, what: str, need: int, detail: str) -> CapacityError:
        """The CapacityError of a write of `need` bytes for `what` that failed for space (`e`); `detail` says what
        stands now, ``{why}`` in it naming the failure."""
        have, why = self._space_left(e)
        return CapacityError(f"{self.subject} ({what}) in {self.dir}", need, have,
                             detail.format(why=why) + self.hint)

    # ---- committed files ---------------------------------------------------------------------------------------

    def read_path(self, key: str, seg: int, rec) -> Path:
        """The file of segment `seg` that `rec` names: the open generation's when it wrote it, else the committed."""
        txn = self.current
        if txn is not None and rec.gen == txn.gen:
            return gen_path(self.dir, key, seg, rec.gen)
        return segment_path(self.dir, key, seg)

    def remove(self, key: str, first_segment: int = 0) -> None:
        """Delete the committed files of `key` from segment `first_segment` on (outside a transaction)."""
        for f in segment_files(self.dir, key):
            if segment_of(f, key) >= first_segment:
                f.unlink(missing_ok=True)
        self._max_segs[key] = min(self._max_segs.get(key, 0), first_segment)

    # ---- transactions -----------------------------------------------------------------------------------------

    @property
    def generation(self) -> int | None:
        """The open transaction's generation (None outside one)."""
        return None if self.current is None else self.current.gen

    def begin(self, need: int, what: str, undo_file: bool = False) -> None:
        """Open a transaction that will write at most `need` bytes: checked and reserved now (CapacityError,
        with nothing written, when they do not fit); `undo_file`: create its undo file now too."""
        if self.current is not None:
            raise RuntimeError("an NVMe state transaction is already open")
        need = int(need)
        self.check_space(need, what)
        gen = self._next_gen
        self._next_gen += 1
        try:
            res = Reservation(self.dir / f".reserve.g{gen}", need)
            txn = Txn(gen, res)
            try:
                if undo_file:
                    txn.undo_fd = os.open(self._undo_path(gen), os.O_RDWR | os.O_CREAT | os.O_EXCL |
                                          getattr(os, "O_NOFOLLOW", 0), 0o600)
            except BaseException:
                self._end(txn)
                raise
        except OSError as e:
            if e.errno not in SPACE_ERRNOS:
                raise
            raise self.space_error(e, what, need, "reserving that space failed with {why}; nothing was written and "
                                   "every previous state file is intact; ") from None
        self.current = txn

    def set_record(self, key: str, rec) -> None:
        """Change the record of `key`; inside a transaction the previous one comes back on abort."""
        if self.current is not None:
            self.current.orig.setdefault(key, self.records.get(key))
        if rec is None:
            self.records.pop(key, None)
        else:
            self.records[key] = rec

    def commit(self) -> None:
        """Switch the open transaction's generation in (its writes have landed): rename its files over the
        committed ones and delete what the old records had beyond."""
        txn, self.current = self.current, None
        if txn is None:
            return
        try:
            for key in txn.orig:
                rec = self.records.get(key)
                now = 0 if rec is None or rec.gen == 0 else self._segments_of(rec.numel)
                if rec is not None and rec.gen == txn.gen:
                    for s in range(now):
                        os.replace(gen_path(self.dir, key, s, txn.gen), segment_path(self.dir, key, s))
                for s in range(now, self._max_segs.get(key, 0)):  # segments the key's new record does not have
                    segment_path(self.dir, key, s).unlink(missing_ok=True)
                self._max_segs[key] = now
        except OSError as e:
            raise CorruptionError(self.dir, f"switching in generation {txn.gen} failed ({e}); the state files are "
                                  "now inconsistent (reads will say so)") from None
        finally:
            for p in txn.written:  # files of generations replaced within the transaction
                p.unlink(missing_ok=True)
            self._end(txn)

    def abort(self) -> None:
        """Drop the open transaction (its writes have finished): delete its files, restore the records of the
        keys it touched. The committed files are as they were before it began."""
        txn = self.current
        if txn is None:
            return
        self.current = None
        for p in txn.written:
            p.unlink(missing_ok=True)
        for key, orig in txn.orig.items():
            if orig is None:
                self.records.pop(key, None)
            else:
                self.records[key] = orig
        self._end(txn)

    def _end(self, txn: Txn) -> None:
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
        txn = self.current
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
            if e.errno not in SPACE_ERRNOS:
                raise
            raise self.space_error(e, "the step's undo log", n, "saving the old weights failed with {why}; the step "
                                   "is undone; ") from None
        txn.undo_len += n
        return off

    def undo_read(self, offset: int, out: memoryview) -> None:
        """Read back bytes of the open transaction's undo file into `out`."""
        txn = self.current
        done = 0
        while done < out.nbytes:
            got = os.preadv(txn.undo_fd, [out[done:]], offset + done)
            if got <= 0:
                raise OSError(errno.EIO, f"undo file {self._undo_path(txn.gen)} is short")
            done += got
