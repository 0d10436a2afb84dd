"""Activation files on a local disk: one checksummed container per tensor, in a private temporary folder.

Writes and reads run on a few IO threads so they overlap compute; files use
fp4offload.formats.container (atomic rename, mode 0600, CRC32 per tensor), so a damaged file raises
CorruptionError when backward reads it. The folder is removed by ``close()`` and, as a last resort,
when the store is garbage collected or the interpreter exits.

A full disk: each write checks the free space of the folder first, and a write that fails for space anyway
(ENOSPC, EDQUOT, EFBIG) is turned into CapacityError. The first such failure marks the store failed and
removes every file it holds at once (the space goes back to the disk, not at exit); every later write and
every read of the store then raises that CapacityError: backward raises it in place of a raw OSError, and
so does the next forward that saves a tensor.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from ..errors import CapacityError, ConfigError, CorruptionError
from ..formats.container import read_container, write_container

_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_HEADER_ALLOWANCE = 4096  # bytes of container header counted when checking free space


def _free(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def _cleanup(folder: Path, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(folder, ignore_errors=True)


class ActivationFileStore:
    """Files of one offload context under ``<root>/fp4offload-act-XXXX/``."""

    def __init__(self, root, workers: int = 2):
        root = Path(root)
        if not root.is_dir():
            raise ConfigError("ActivationPolicy.nvme_path", str(root), "an existing folder",
                              "create it first, on a fast local disk")
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigError("ActivationPolicy.nvme_path", str(root), "a folder this process can write to")
        self.folder = Path(tempfile.mkdtemp(prefix="fp4offload-act-", dir=root))  # mode 0700
        self._io = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp4offload-nvme")
        self._finalizer = weakref.finalize(self, _cleanup, self.folder, self._io)
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
                need = sum(t.numel() * t.element_size() for t in ts.values()) + _HEADER_ALLOWANCE
                free = _free(self.folder)
                if need > free:
                    raise self._fail(need, free, "the disk is full")
                try:
                    n = write_container(path, dict(meta, key=key), ts, fsync=False)
                except OSError as e:
                    if self.failed is not None:  # the folder went with another write's failure
                        raise self._failure() from None
                    if e.errno not in _SPACE_ERRNOS:
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
                self.failed = CapacityError(*self._fail_args)
                shutil.rmtree(self.folder, ignore_errors=True)
        return self._failure()

    def _failure(self) -> CapacityError:
        """A new CapacityError like the first failure (one per raise: each carries its own traceback)."""
        return CapacityError(*self._fail_args)

    def read(self, key: int, after: Future | None = None) -> Future:
        """Read the file of `key` (after `after`, its write, is done); the future raises CorruptionError."""
        path = self.path(key)

        def job():
            if after is not None:
                after.result()
            if self.failed is not None:
                raise self._failure()
            meta, tensors = read_container(path)
            if meta.get("key") != key:
                raise CorruptionError(path, "file holds another activation", expected=key, found=meta.get("key"))
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
        return sorted(self.folder.glob("*")) if self.folder.exists() else []

    def close(self) -> None:
        """Wait for the IO threads, then remove the folder and everything in it."""
        self.closed = True
        self._finalizer()
