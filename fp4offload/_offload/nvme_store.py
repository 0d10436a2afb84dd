"""Activation files on a local disk: one checksummed container per tensor, in a private folder of fp4offload/_store.

The folder ``<nvme_path>/fp4offload-act-XXXXXXXX/`` (mode 0700; _store/folder.py) holds a lock file naming this
process while the store lives. It is removed by ``close()`` and, as a last resort, when the store is garbage
collected or the interpreter exits; a folder whose process died (killed, crashed) is removed by the next store
that starts on that path, with a warning on the ``fp4offload._offload`` logger.

Writes and reads run on a few I/O threads so they overlap compute, through the store's engine (_store/engines.py),
chosen once per process and path: DeepSpeed's async_io (O_DIRECT, page-locked buffers, the file laid out in whole
4 KiB blocks) when it loads and a probe write and read work on that disk, else buffered I/O through the container
module (one warning says why). The page-locked buffers are bounded: a file for which the process could not lock
more memory is read or written buffered. Either way a file is fp4offload's container (atomic rename, mode 0600,
CRC32 per tensor), so a damaged file raises CorruptionError when backward reads it.

A full disk: each write checks the free space of the folder first, and a write that fails for space anyway
(ENOSPC, EDQUOT, EFBIG) is turned into CapacityError. The first such failure marks the store failed and
removes every file it holds at once (the space goes back to the disk, not at exit); every later write and
every read of the store then raises that CapacityError: backward raises it in place of a raw OSError, and
so does the next forward that saves a tensor.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch

from .._store.aio import ALIGN
from .._store.engines import AioEngine, ThreadEngine, Workers, start_engine
from .._store.folder import Folder, sweep
from .._store.segment import file_disk_bytes
from .._store.txn import SPACE_ERRNOS
from ..errors import CapacityError, ConfigError, CorruptionError

FOLDER_PREFIX = "fp4offload-act-"
IDLE_LOCKED_BYTES = 256 << 20  # page-locked buffers the aio engine keeps for reuse between files
log = logging.getLogger("fp4offload._offload")

_engines: dict[tuple, tuple[ThreadEngine | AioEngine, str | None]] = {}
_engines_lock = threading.Lock()


def engine_for(root: Path, folder: Path) -> tuple[ThreadEngine | AioEngine, str | None]:
    """The I/O engine of activation files under `root` and why aio does not run (None when it does): started
    once per process and root (its probe runs in `folder`, a new store's), kept for the next stores."""
    key = (os.getpid(), str(root.resolve()))
    with _engines_lock:
        got = _engines.get(key)
        if got is None:
            got = _engines[key] = start_engine("auto", folder, 2 * ALIGN, what="the activations' NVMe store",
                                               logger=log, max_idle_bytes=IDLE_LOCKED_BYTES, bounded=True)
        return got


def _free(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


class ActivationFileStore:
    """Files of one offload context under ``<root>/fp4offload-act-XXXX/``. ``io``: the engine that reads and writes
    them (``"aio"`` or ``"threads"``), ``io_reason``: why aio does not run (None when it does); ``swept``: folders of
    dead processes this store removed when it started."""

    def __init__(self, root, workers: int = 2):
        root = Path(root)
        if not root.is_dir():
            raise ConfigError("ActivationPolicy.nvme_path", str(root), "an existing folder",
                              "create it first, on a fast local disk")
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigError("ActivationPolicy.nvme_path", str(root), "a folder this process can write to")
        self.swept = sweep(root, FOLDER_PREFIX, "NVMe activation folder", log)
        self._folder = Folder(root, FOLDER_PREFIX)  # mode 0700
        self.folder = self._folder.path
        self._finalizer = weakref.finalize(self, self._folder)
        try:
            self._folder.lock()
            self._engine, self.io_reason = engine_for(root, self.folder)
        except BaseException:
            self._finalizer()
            raise
        self.io = self._engine.name
        self._io = Workers(workers, name="fp4offload-nvme", max_pending_writes=None)
        self._folder.closers = [self._io.shutdown]
        self.closed = False
        self.failed: CapacityError | None = None  # the first write that did not fit; the store is empty since
        self._fail_lock = threading.Lock()

    def path(self, key: int) -> Path:
        return self.folder / f"act-{key:08d}.fp4c"

    def write(self, key: int, meta: dict, tensors: Callable[[], dict[str, torch.Tensor]],
              done: Callable[[], None] | None = None) -> Future:
        """Write the tensors that `tensors()` returns (called on the IO thread) to the file of `key`."""
        path = self.path(key)
        if self.failed is not None:  # nothing more is written: the read in backward raises the failure
            if done is not None:
                done()
            fut: Future = Future()
            fut.set_exception(self._failure())
            return fut

        def job():
            try:
                if self.failed is not None:
                    raise self._failure()
                ts = tensors()
                need = file_disk_bytes(sum(t.numel() * t.element_size() for t in ts.values()), len(ts))
                free = _free(self.folder)
                if need > free:
                    raise self._fail(need, free, "the disk is full")
                try:
                    n = self._engine.write(path, dict(meta, key=key), ts, False)
                except OSError as e:
                    if self._has_failed():  # the folder went with another write's failure
                        raise self._failure() from None
                    if e.errno not in SPACE_ERRNOS:
                        raise
                    raise self._fail(need, _free(self.folder),
                                     f"the write failed with {errno.errorcode.get(e.errno, e.errno)}") from None
                if self.failed is not None:  # another write failed meanwhile: this file goes too
                    path.unlink(missing_ok=True)
                    raise self._failure()
                return n
            finally:
                if done is not None:
                    done()

        return self._io.submit(job)

    def _fail(self, need: int, have: int, why: str) -> CapacityError:
        """Mark the store failed (the first time) and remove every file it holds; returns the error to raise."""
        with self._fail_lock:
            if self.failed is None:
                self._fail_args = (f"activation files in {self.folder}", need, max(have, 0),
                                   f"{why} ({need} bytes needed, {max(have, 0)} free); every activation file of "
                                   "this store was removed, with its folder; free space on that disk, point "
                                   "activations.nvme_path at a larger one, or use activations.device 'cpu'")
                shutil.rmtree(self.folder, ignore_errors=True)
                self.failed = CapacityError(*self._fail_args)  # set once the folder is gone: others raise after
        return self._failure()

    def _has_failed(self) -> bool:
        """Whether the store failed, waiting for a failure's removal of the folder that is under way."""
        with self._fail_lock:
            return self.failed is not None

    def _failure(self) -> CapacityError:
        """A new CapacityError like the first failure (one per raise: each carries its own traceback), returned once
        the folder is gone: a write on another I/O thread may have made a file between the removal's listing and
        its rmdir, and then the folder is removed again here (with it gone, no write can make another)."""
        with self._fail_lock:
            if self.folder.exists():
                shutil.rmtree(self.folder, ignore_errors=True)
        return CapacityError(*self._fail_args)

    def read(self, key: int, after: Future | None = None) -> Future:
        """Read the file of `key` (after `after`, its write, is done); the future raises CorruptionError."""
        path = self.path(key)

        def job():
            if after is not None:
                after.result()
            if self.failed is not None:
                raise self._failure()
            try:
                meta, tensors = self._engine.read(path, copy=True)
            except OSError:
                if self._has_failed():  # the folder went with a write's failure while this read ran
                    raise self._failure() from None
                raise
            if meta.get("key") != key:
                raise CorruptionError(path, "file holds another activation", expected=key, found=meta.get("key"))
            tensors.pop("_pad", None)  # the aio layout's trailing zeros
            return tensors

        return self._io.submit(job)

    def delete(self, key: int, after: Future | None = None) -> None:
        """Remove the file of `key` (once its write is over, if one is in flight)."""
        path = self.path(key)

        def rm(_=None):
            try:
                path.unlink()
            except OSError:
                pass

        if after is not None and not after.done():
            after.add_done_callback(rm)
        else:
            rm()

    def files(self) -> list[Path]:
        """The files of the stored activations."""
        return sorted(self.folder.glob("act-*.fp4c")) if self.folder.exists() else []

    def close(self) -> None:
        """Wait for the IO threads, then remove the folder and everything in it."""
        self.closed = True
        self._finalizer()
